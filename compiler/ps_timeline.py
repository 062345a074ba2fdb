"""The synchronous parameter-server step played out on the step timeline (compiler/step_timeline.py), as
`--parallel auto` plays out data parallel and the pipelines.

The parameters are shared out to S servers largest first to the lightest (as passes/ps_cost.py and
compiler/ps_training.py balance them). Each of the W workers is a program: it receives each server's shard of the
weights (a pull), runs one data-parallel replica's forward and backward kernels (its all-reduces and its update
left out), then sends each server its shard of the gradient (a push). Each server, a process of its own with its
own link, is a program too: it sends its shard to every worker in turn, receives every worker's gradient, then
updates its shard (the replica's update kernels' time in proportion to the shard's bytes). The servers' links
carrying W shards each way are the bottleneck with few servers; the workers' links carry the whole model once each
way. The step ends when the last server has updated: the next step's pulls wait for it.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from tessel.runtime.instructions import AllReduce, Instruction, KernelCall, Recv, Send

from .step_timeline import TRANSFER, UPDATE, Timeline, WorkerProgram, simulate

UPDATE_NODE = "ps_update_"  # + the server's index: a server's update, a kernel call of the played-out step


def shard_loads(parameter_bytes: Sequence[int], servers: int) -> list[int]:
    """Bytes each of `servers` servers holds: the parameters shared out largest first to the lightest."""
    loads = [0] * servers
    for size in sorted(parameter_bytes, reverse=True):
        loads[loads.index(min(loads))] += size
    return loads


def ps_programs(replica: WorkerProgram, workers: int, loads: Sequence[int]) -> list[WorkerProgram]:
    """The W workers' and then the S servers' step programs (ranks 0..W-1, then W..W+S-1) for shards of `loads`
    bytes, from a data-parallel `replica`; server s updates in the kernel call UPDATE_NODE + s."""
    servers = len(loads)
    values = {**replica.values, **{f"ps_shard_{s}": f"uint8[{load}]" for s, load in enumerate(loads)}}
    compute = [(i, phase) for i, phase in zip(replica.instructions, replica.phases)
               if phase != UPDATE and not isinstance(i, AllReduce)]
    pulls = [(Recv(f"ps_pull_{s}", "Recv", output=f"ps_shard_{s}", peer=workers + s, tag=s), TRANSFER)
             for s in range(servers)]
    pushes = [(Send(f"ps_push_{s}", "Send", tensor=f"ps_shard_{s}", peer=workers + s, tag=servers + s), TRANSFER)
              for s in range(servers)]
    worker = _program([*pulls, *compute, *pushes], values)
    programs = [worker] * workers
    for s in range(servers):
        sends = [(Send(f"ps_pull_{s}", "Send", tensor=f"ps_shard_{s}", peer=w, tag=s), TRANSFER)
                 for w in range(workers)]
        receives = [(Recv(f"ps_push_{s}", "Recv", output=f"ps_shard_{s}", peer=w, tag=servers + s), TRANSFER)
                    for w in range(workers)]
        update = (KernelCall(f"{UPDATE_NODE}{s}", "Update", kernel=f"{UPDATE_NODE}{s}", inputs=(), outputs=()), UPDATE)
        programs.append(_program([*sends, *receives, update], values))
    return programs


def simulate_ps(replica: WorkerProgram, workers: int, parameter_bytes: Sequence[int], servers: int,
                kernel_s: Callable[[KernelCall], float], link, start_s: float = 0.0) -> Timeline:
    """The parameter-server step on `servers` servers played out (see the module's docstring)."""
    loads = shard_loads(parameter_bytes, servers)
    update_s = sum(kernel_s(i) for i, phase in zip(replica.instructions, replica.phases)
                   if phase == UPDATE and isinstance(i, KernelCall))
    total = sum(loads) or 1
    programs = ps_programs(replica, workers, loads)
    update_of = {f"{UPDATE_NODE}{s}": update_s * load / total for s, load in enumerate(loads)}

    def seconds(call: KernelCall) -> float:
        return update_of[call.node] if call.node in update_of else kernel_s(call)

    return simulate(programs, seconds, link, link.seconds, start_s)


def _program(steps: Sequence[tuple[Instruction, str]], values: Mapping[str, str]) -> WorkerProgram:
    return WorkerProgram([i for i, _ in steps], [phase for _, phase in steps], values)
