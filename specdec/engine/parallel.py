"""Tensor-parallel engine processes over torch.distributed (gloo on CPU, nccl on CUDA).

Rank 0 is the engine: it schedules, drafts, verifies and samples, exactly as with one process. Its runner
(`TPRunner`) mirrors every call that touches the target to the other ranks before making it itself: the
step's layout (block tables, start slots, token ids, tree layouts: a few hundred bytes, pickled and
broadcast), the rows that need logits, and the K/V moves after a tree is verified. Every rank then runs its
share of the same forward (`models.parallel`), meeting the others in two all-reduces per layer and one
gather of the logits, so the logits, and every decision rank 0 makes from them, are the same everywhere.
Block tables come from rank 0's allocator, so each rank's share of the paged KV cache is addressed by the
same slots. Drafters run on rank 0 only (an n-gram index, a suffix tree, a draft model or an EAGLE head
over the replicated features); a method registered as running the target's own layers
(`MethodInfo.runs_target_layers`: self-speculation) would need every rank and is refused.

`LLM(..., tensor_parallel_size=N)` spawns ranks 1..N-1 (`Workers`), or, under `torchrun`, the ranks
other than 0 call `serve_rank()` and wait for rank 0's commands. Every collective has the process group's
timeout, and rank 0 checks that the spawned ranks are alive before each command: a rank that dies turns
into a SpecdecError naming it, never a hang.
"""
from __future__ import annotations

import datetime
import os
import platform
import secrets
import socket
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from specdec.config import SpecdecError
from specdec.engine.model_runner import ModelRunner
from specdec.kv_cache import KVPool
from specdec.models.llama import LlamaModel
from specdec.models.parallel import SharedExchange, TPGroup, shard_model
from specdec.tree import TreeFeed

DEFAULT_TIMEOUT_S = 120.0
SHARED_SLOT_FLOATS = 1 << 20  # 4 MB a rank and half: all-reduces of up to 1,820 tokens of 576, 42 rows of logits


COMMAND_TIMEOUT = datetime.timedelta(days=30)  # an idle server's ranks wait this long for the next command
STOP_TIMEOUT = datetime.timedelta(seconds=30)  # at stop, how long the ranks wait for each other before tearing down
_commands = None  # the process group commands travel on (gloo, the long timeout)


def init_process_group(backend: str, **kwargs: Any) -> None:
    """torch.distributed.init_process_group, with torch.distributed.nn imported first. That module binds the
    default group as a default argument of its functions (`group=group.WORLD`) when it is first imported:
    imported after the group exists (loading a tokenizer with transformers imports it), it would hold the group
    past destroy_process_group, and the group's gloo threads would run on into interpreter exit, where one still
    releasing a collective's tensors needs the GIL; Python ends that thread instead, and the unwinding aborts
    the process (SIGABRT, "terminate called without an active exception"). Imported first, it binds None."""
    import torch.distributed.nn  # noqa: F401

    dist.init_process_group(backend, **kwargs)


def destroy_process_groups() -> None:
    """Destroy every process group of this process, the commands group's reference here included, so that the
    groups go now, and their gloo threads with them, not at interpreter exit (see init_process_group)."""
    global _commands
    _commands = None
    if dist.is_initialized():
        dist.destroy_process_group()


def init_group(rank: int, world: int, device: torch.device, timeout_s: float, init_method: str | None = None
               ) -> TPGroup:
    """Join the ranks: the default group (the model's collectives, `timeout_s` each) and a gloo group for rank
    0's commands, whose timeout only bounds how long a rank may sit idle."""
    global _commands
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                       timeout=datetime.timedelta(seconds=timeout_s))
    _commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return TPGroup(rank, world, shared=_shared_exchange(rank, world, device, timeout_s))


def _shared_exchange(rank: int, world: int, device: torch.device, timeout_s: float) -> SharedExchange | None:
    """A shared-memory exchange when every rank runs on this host, on CPU, on x86 (see SharedExchange)."""
    hosts = [None] * world
    dist.all_gather_object(hosts, (socket.gethostname(), platform.machine()), group=_commands)
    if device.type != "cpu" or len(set(hosts)) != 1 or hosts[0][1] not in ("x86_64", "AMD64"):
        return None
    box = [f"specdec_tp_{os.getpid()}_{secrets.token_hex(4)}" if rank == 0 else None]
    if rank == 0:
        exchange = SharedExchange(box[0], rank, world, SHARED_SLOT_FLOATS, True, timeout_s)
    dist.broadcast_object_list(box, src=0, group=_commands)
    if rank != 0:
        exchange = SharedExchange(box[0], rank, world, SHARED_SLOT_FLOATS, False, timeout_s)
    dist.barrier(group=_commands)
    return exchange


def _send(cmd: tuple) -> None:
    dist.broadcast_object_list([cmd], src=0, group=_commands)


def _receive() -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_commands)
    return box[0]


def _stopped() -> None:
    """Every rank has seen "stop" before any tears its groups down (a gloo group closed under a peer still
    reading from it can abort that process); bounded, so a rank that died does not hold the others."""
    try:
        dist.monitored_barrier(group=_commands, timeout=STOP_TIMEOUT)
    except RuntimeError:
        pass


def serve_rank(model: LlamaModel, tp: TPGroup) -> None:
    """A rank other than 0: run the target's share of every call rank 0 mirrors, until it says stop."""
    runners: dict[int, ModelRunner] = {}  # one per engine of rank 0 (LLM.with_speculative_config adds engines)
    last: dict[int, torch.Tensor] = {}  # each engine's last forward's hidden states (logits are taken from them)
    while True:
        cmd = _receive()
        kind, engine = cmd[0], cmd[1] if len(cmd) > 1 else None
        if kind == "stop":
            _stopped()
            break
        if kind == "kv":
            num_blocks, block_size, dtype = cmd[2:]
            runners[engine] = ModelRunner(model, KVPool(model.kv_config, num_blocks, block_size, dtype, model.device),
                                          block_size)
        elif kind == "run":
            last[engine] = runners[engine].run(*cmd[2:])[0]
        elif kind == "logits":
            runners[engine].logits(last[engine], cmd[2])
        elif kind == "compact":
            runners[engine].compact(*cmd[2:])
        elif kind == "release":
            runners.pop(engine, None)
            last.pop(engine, None)


def main(argv: list[str] | None = None) -> None:
    """A spawned rank; argv: RANK WORLD ADDRESS MODEL DTYPE DEVICE QUANT TIMEOUT THREADS (DTYPE 'auto' or a torch
    dtype's name, QUANT '-' for none)."""
    import sys

    from specdec.models.loader import load_model

    rank, world, address, model, dtype, device, quant, timeout_s, threads = (argv or sys.argv[1:])
    _die_with_parent()
    share_threads(int(threads))
    tp = init_group(int(rank), int(world), torch.device(device), float(timeout_s), address)
    net, _ = load_model(model, dtype if dtype == "auto" else getattr(torch, dtype), device,
                        None if quant == "-" else quant)
    shard_model(net, tp)
    try:
        serve_rank(net, tp)
    finally:
        if tp.shared is not None:
            tp.shared.close(unlink=False)
        destroy_process_groups()


def share_threads(threads: int) -> None:
    """This rank's share of the cores for torch's OpenMP pool, which the C++ kernels share (ranks on one machine
    that each used every core would fight over them: measured 10x slower steps on 2 cores)."""
    torch.set_num_threads(threads)


def _die_with_parent() -> None:
    """Linux: be killed when rank 0's process goes (a spawned rank never outlives its engine)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Ranks 1..N-1 as child processes (spawned), or the ranks torchrun started (`processes` empty)."""

    def __init__(self, tp: TPGroup, processes: list) -> None:
        self.tp, self.processes = tp, processes
        self.closed = False  # no more commands (shut down, or a rank failed)
        self.shut = False  # close() ran: the ranks, the group, the shared memory and the threads are given back
        self._finalizer: weakref.finalize | None = None  # spawned ranks: what goes at exit without close()
        self._engines = 0
        self.released: list[int] = []  # engines of rank 0 that were collected: their pools go at the next command

    @classmethod
    def spawn(cls, world: int, model: str, dtype: torch.dtype | str, device: torch.device, quantization: str | None,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> Workers:
        """Start ranks 1..world-1 as fresh interpreters (`main`: no script of the user's is re-imported) loading
        the same model, and join them as rank 0; each rank gets an equal share of this machine's threads (this
        process's count comes back at close(), or at exit)."""
        import subprocess
        import sys

        if dist.is_initialized():
            raise SpecdecError("a tensor-parallel engine already runs in this process (torch.distributed is "
                               "initialized); call shutdown() on its LLM first")
        address = f"tcp://127.0.0.1:{free_port()}"
        found = torch.get_num_threads()
        threads = max(1, found // world)
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        entry = "import sys; from specdec.engine.parallel import main; main(sys.argv[1:])"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
        procs = [subprocess.Popen([sys.executable, "-c", entry, str(r), str(world), address, str(model), name,
                                   str(device), quantization or "-", str(timeout_s), str(threads)], env=env)
                 for r in range(1, world)]
        try:
            tp = init_group(0, world, device, timeout_s, address)
        except Exception as e:
            Workers._stop(procs)
            codes = [p.poll() for p in procs]
            raise SpecdecError(f"tensor parallel: the other rank(s) did not join (exit codes {codes}; "
                               f"{type(e).__name__}: {e})") from None
        share_threads(threads)
        workers = cls(tp, procs)
        if tp.shared is not None:
            tp.shared.alive = workers.gone
        workers._finalizer = weakref.finalize(workers, Workers._release, procs, tp.shared, (found, threads))
        return workers

    def new_engine(self) -> int:
        self._engines += 1
        return self._engines

    def gone(self) -> str | None:
        """Why the ranks cannot go on (a spawned rank exited), or None."""
        for r, p in enumerate(self.processes, start=1):
            if p.poll() is not None:
                return f"rank {r} exited (code {p.returncode})"
        return None

    def send(self, cmd: tuple) -> None:
        """Mirror a command to every other rank (after checking the spawned ones are alive)."""
        if self.closed:
            raise SpecdecError("tensor parallel: the other ranks were shut down")
        if (gone := self.gone()) is not None:
            self.closed = True
            raise SpecdecError(f"tensor parallel: {gone}; the engine cannot go on")
        try:
            while self.released:  # sent from the engine's own thread, never from the garbage collector
                _send(("release", self.released.pop()))
            _send(cmd)
        except RuntimeError as e:
            self.closed = True
            raise SpecdecError(f"tensor parallel: a rank stopped answering ({e})") from None

    def close(self) -> None:
        """Stop the other ranks (in order while they still answer; a rank failed: the others are killed), then
        give back what this process holds for them: the shared memory, the process group, its threads."""
        if self.shut:
            return
        self.shut = True
        if not self.closed:
            self.closed = True
            try:
                _send(("stop",))
                _stopped()
            except RuntimeError:
                pass
            for p in self.processes:
                try:
                    p.wait(timeout=10)
                except Exception:
                    pass
        Workers._stop(self.processes)
        if self.tp.shared is not None:
            self.tp.shared.close(unlink=self.tp.rank == 0)
        destroy_process_groups()
        if self._finalizer is not None:
            self._finalizer()  # the thread count back (it runs once: not again at exit)

    @staticmethod
    def _release(processes: list, shared: SharedExchange | None, threads: tuple[int, int] | None = None) -> None:
        """At close(), exit or collection without shutdown(): stop the spawned ranks, remove the shared memory,
        and give back the thread count rank 0 found (threads: (found, its share)), unless it was changed since."""
        Workers._stop(processes)
        if shared is not None and shared.shm is not None:
            shared.close(unlink=True)
        if threads is not None and torch.get_num_threads() == threads[1]:
            torch.set_num_threads(threads[0])

    @staticmethod
    def _stop(processes: list) -> None:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


class TPRunner(ModelRunner):
    """Rank 0's runner: every target call is mirrored to the other ranks first (see the module docstring)."""

    def __init__(self, model: LlamaModel, kv: KVPool, block_size: int, workers: Workers) -> None:
        super().__init__(model, kv, block_size)
        self.workers, self.engine_id = workers, workers.new_engine()
        workers.send(("kv", self.engine_id, kv.k[0].shape[0] // block_size, block_size, kv.k[0].dtype))
        weakref.finalize(self, workers.released.append, self.engine_id)  # the other ranks free its pool later

    def run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
            trees: list[TreeFeed | None] | None = None, feature_layers: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.workers.send(("run", self.engine_id, tables, starts, feeds, trees, feature_layers))
        return self._collective(super().run, tables, starts, feeds, trees, feature_layers)

    def run_logits(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
                   trees: list[TreeFeed | None] | None, feature_layers: tuple[int, ...], rows: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        hidden, features = self.run(tables, starts, feeds, trees, feature_layers)  # every rank, then the gather
        return hidden, features, self.logits(hidden, rows)

    def logits(self, hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        self.workers.send(("logits", self.engine_id, rows))
        return self._collective(super().logits, hidden, rows)

    def compact(self, table: list[int], start: int, nodes: list[int]) -> None:
        if any(node != depth for depth, node in enumerate(nodes)):
            self.workers.send(("compact", self.engine_id, table, start, nodes))
            super().compact(table, start, nodes)

    def _collective(self, fn: Callable[..., Any], *args):
        try:
            return fn(*args)
        except RuntimeError as e:  # a peer died or timed out inside an all-reduce or gather
            self.workers.closed = True
            raise SpecdecError(f"tensor parallel: a collective failed ({str(e).splitlines()[0]})") from None


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
