"""Graph passes and planners (Graph -> PassResult; planners return plan dataclasses)."""
