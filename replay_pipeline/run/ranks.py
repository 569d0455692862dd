"""The learner's data-parallel ranks (`learner.world_size` > 1): rank 0 is the run's own
learner in the flow's process, ranks 1..N-1 are processes of their own (`loop.engine=local`:
spawned children; `loop.engine=ray`: Ray actors placed by replay_pipeline/run/ray_engine.py)
that hold a replica of the model and its optimizer (or, with learner.shard=fsdp2, a shard of
them) and take part in every learner step.

    flow process: rank 0                                   rank r: a process or a Ray actor
    ────────────────────                                   ────────────────────────────────
    TCPStore (command channel) + process group ◄──────────► join the group (learner.timeout)
    "start": the learner's settings, model config ─────────► build the model and the Learner
    broadcast weights, reference, optimizer, step count ───► load them (FSDP2: their shards)
    each round: "round" + the drawn minibatches ───────────► apply_updates on the same minibatches
      apply_updates: its share of the rows ◄── all-reduce ──►  its share of the rows
    FSDP2, each round and checkpoint: "gather" ◄──────────► the whole state onto rank 0
    close: "stop" ─────────────────────────────────────────► leave the group, exit

Decisions:
* **Replicas, gradients all-reduced** (Learner(group=...): what DDP does, without its wrapper):
  every rank holds the whole model and AdamW state, so checkpoints, the published weights, the
  MLflow model and vLLM's loading are rank 0's, exactly as in a one-process run, and a run may
  resume with another world size. That suits a model whose weights, gradients and optimizer
  state fit one device; sharding them (FSDP2) is for larger ones.
* **Sharded (learner.shard=fsdp2): the whole state only through collectives.** Each rank holds
  1/N of the weights, gradients and AdamW moments (replay_pipeline/training/sharding.py). What
  a run does with the weights goes through rank 0's one-process copy of them, made by a
  collective every rank joins: the start loads rank 0's weights (a resume's checkpoint) into
  every shard, each round ends with a "gather" of the weights for rank 0's generator (its own
  whole copy: it cannot sample from a shard) and the async loop's publication, and each
  checkpoint gathers the weights and optimizer state, so a checkpoint is a one-process run's
  and loads anywhere one does. replay_pipeline/run/handover.py has the details and what rank
  0 holds in memory. Nothing a run can be configured to do needs Learner.gradient() (refused
  under FSDP2): reuse rules read the step's diagnostics, grad_spike's norm is all-reduced, and
  `measure` builds its own one-process learner from a checkpoint.
* **Drawn once, handed to every rank.** Rank 0 alone reads the buffer, draws the minibatches,
  writes the usage records, checkpoints and publishes; the other ranks open no table, write
  no file and need no shared filesystem: their model's configuration, the learner's
  settings and every round's minibatches (a few hundred KB) reach them through the process
  group's own key-value store (`TCPStore`, hosted by rank 0), the weights and optimizer state
  through a broadcast at start. Each rank then trains on its contiguous share of the rows
  (Learner._parts) and the sums of gradients and diagnostics are all-reduced (FSDP2: the
  gradients reduce-scattered), so every rank takes the update one process would take on the
  whole minibatch (equal within float rounding: tests/integration/test_learner_ranks_equivalence.py), and
  adaptive reuse decides alike on every rank (it reads the all-reduced diagnostics).
* **Nothing hangs without an error.** Every collective (the start's broadcast, each step's
  all-reduce) runs under `learner.timeout` seconds. Between rounds a rank waits on the store
  for the next command in short polls, with no limit (rank 0 may spend an hour evaluating),
  and ends when rank 0 is gone (the store's server went with it, or, for a child process,
  its parent died). A rank that dies makes rank 0's next collective fail at once (gloo sees
  the connection close) or time out; rank 0 also checks every rank is alive before each
  round. Either way the run stops with one line naming the rank (`RankLost`) and resumes from
  its newest checkpoint, bit for bit with the same world size.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from replay_pipeline.algo.reuse import ReusePolicy, apply_updates
from replay_pipeline.run.handover import WholeState, gather_state, receive_state, send_state
from replay_pipeline.system import faults
from replay_pipeline.training.learner import Learner

#: Seconds a rank waits on the store for the next command before it checks that rank 0 lives.
POLL_SECONDS = 2.0
#: Seconds rank 0 gives the other ranks to leave after "stop" before it kills them.
STOP_GRACE = 30.0
#: Seconds the other ranks may take to start (a process importing torch and transformers, a Ray
#: actor placed and started) before rank 0 gives up on them; learner.timeout starts after.
JOIN_SECONDS = 600.0
_KEY = "replay-pipeline/"


class RankLost(RuntimeError):
    """A learner rank died or stopped answering: the run stops and resumes from its newest
    checkpoint."""


def learner_kwargs(settings: Any, pad_id: int) -> dict[str, Any]:
    """The Learner's keyword arguments from a run's settings (every rank builds its learner
    from these)."""
    a = settings.algo
    return dict(objective=a.objective, lr=a.lr, objective_params=dict(settings.objective_params),
                kl_coef=a.kl_coef, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg,
                max_grad_norm=a.max_grad_norm, weight_decay=a.weight_decay,
                betas=(a.adam_beta1, a.adam_beta2), temperature=settings.generator.temperature, pad_id=pad_id,
                micro_batch_size=a.micro_batch_size, shard=settings.learner.shard)


def make_learner(model: Any, kwargs: dict[str, Any], watch: str | None, group: Any = None) -> Learner:
    """A Learner on `model` (one rank of `group` when given), watching parameter group `watch`
    (reuse.rule=grad_spike's signal) when not None."""
    learner = Learner(model, group=group, **kwargs)
    if watch is not None:
        learner.watch(watch)
    return learner


def backend_for(device: torch.device, backend: str) -> str:
    """learner.backend: `auto` is NCCL for CUDA devices, gloo otherwise."""
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def free_port(host: str) -> int:
    """A TCP port free on `host` now (bound and released: the store binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the other ranks
def learner_rank(rank: int, world_size: int, host: str, port: int, timeout: float, backend: str,
                 device: str, threads: int, parent_pid: int | None = None) -> dict[str, Any]:
    """Body of learner rank `rank` (> 0): join rank 0's store and process group, build the
    model and learner it describes, load its state, then apply every round's minibatches until
    "stop". A spawn target (`parent_pid`: the flow's pid) or a Ray actor's method. Returns
    {"rank", "steps", "rounds", "pid", "host"}."""
    if parent_pid is not None:  # Ctrl-C reaches the terminal's whole group; rank 0 decides
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(int(threads), 1))
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=JOIN_SECONDS))
    store.set(f"{_KEY}ready/{rank}", socket.gethostname())  # started: rank 0 now joins the group
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        start = _next_command(store, 0, parent_pid)
        assert start[0] == "start", start[0]
        spec = start[1]
        model = _model_from_config(spec["model_config"]).to(device=torch.device(device), dtype=spec["dtype"])
        learner = make_learner(model, spec["kwargs"], spec["watch"], group=dist.group.WORLD)
        receive_state(learner)
        rounds, n = 0, 1
        while True:
            kind, payload = _next_command(store, n, parent_pid)
            n += 1
            if kind == "stop":
                break
            if kind == "gather":  # FSDP2: the whole state onto rank 0 (a checkpoint, the generator's weights)
                gather_state(learner, optimizer=payload)
                continue
            minibatches, policy = payload
            faults.crash_point("learner_rank", learner.steps)
            apply_updates(learner, minibatches, policy)
            rounds += 1
        return {"rank": rank, "steps": learner.steps, "rounds": rounds, "pid": os.getpid(),
                "host": socket.gethostname()}
    finally:
        dist.destroy_process_group()


def _model_from_config(config: dict[str, Any]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up cost: transformers' model classes

    config = dict(config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))


def _next_command(store: Any, n: int, parent_pid: int | None) -> tuple[str, Any]:
    """Command `n` from rank 0, waiting in polls of POLL_SECONDS for as long as rank 0 lives."""
    key = f"{_KEY}cmd/{n}"
    while True:
        try:
            store.wait([key], timedelta(seconds=POLL_SECONDS))
            return pickle.loads(store.get(key))
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise RankLost(f"rank 0's store stopped answering ({exc}): the run ended") from exc
        if parent_pid is not None and os.getppid() != parent_pid:
            raise RankLost("rank 0 (the flow's process) is gone")


# --------------------------------------------------------------------------- rank 0's side
class LearnerRanks:
    """Rank 0's handle on the group: the store it hosts, the process group, the other ranks'
    processes (handles with is_alive(), kill(), describe()). Start with `start`, hand each
    round's minibatches to the other ranks with `round` before rank 0's own apply_updates,
    end with `close`."""

    def __init__(self, store: Any, handles: dict[int, Any], world_size: int, timeout: float,
                 on_close: Callable[[], Any] | None = None):
        self.store = store
        self.on_close = on_close  # the engine's resources (a Ray session and placement group)
        self.handles = handles
        self.world_size = world_size
        self.timeout = timeout
        self.sent = 0  # commands sent so far
        self.dropped = 0  # commands below this number are deleted from the store
        self.closed = False
        self.failed = False  # a collective failed: close() does not wait for the ranks

    @property
    def group(self) -> Any:
        return dist.group.WORLD

    @classmethod
    def start(cls, world_size: int, timeout: float, backend: str, device: torch.device, threads: int,
              launch: Callable[..., dict[int, Any]], host: str = "127.0.0.1", log: Callable[[str], Any] = print,
              on_close: Callable[[], Any] | None = None) -> "LearnerRanks":
        """Host the store, start ranks 1..N-1 with `launch(ranks, args_for)` (it returns
        {rank: handle}; `args_for(rank)` gives learner_rank's arguments), and join the process
        group as rank 0. Raises RankLost naming the ranks that did not join within `timeout`."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process; "
                               "learner.world_size > 1 starts its own (one run a process)")
        backend = backend_for(device, backend)
        port = free_port(host)
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=JOIN_SECONDS),
                              wait_for_workers=False)
        other_device = "cuda" if device.type == "cuda" else str(device)

        def args_for(rank: int) -> tuple:
            return (rank, world_size, host, port, timeout, backend, other_device, threads)

        began = time.perf_counter()
        handles = launch(list(range(1, world_size)), args_for)
        ranks = cls(store, handles, world_size, timeout, on_close)
        try:
            ranks.wait_started()
            dist.init_process_group(backend, store=store, rank=0, world_size=world_size,
                                     timeout=timedelta(seconds=timeout))
        except Exception as exc:
            ranks.kill()
            if on_close is not None:
                on_close()
            if isinstance(exc, RankLost):
                raise
            raise RankLost(f"the learner's {world_size} ranks did not form a process group within "
                           f"learner.timeout={timeout:g} s ({ranks.describe_dead() or 'all alive'}): {exc}") from exc
        log(f"learner: {world_size} data-parallel ranks ({backend}), joined in {time.perf_counter() - began:.1f} s")
        return ranks

    def wait_started(self, limit: float = JOIN_SECONDS) -> None:
        """Until every other rank has started (its `ready` key is set), at most `limit` s;
        RankLost at once if one exits first."""
        deadline = time.monotonic() + limit
        for rank in sorted(self.handles):
            while True:
                try:
                    self.store.wait([f"{_KEY}ready/{rank}"], timedelta(seconds=0.2))
                    break
                except dist.DistStoreError:
                    if not self.handles[rank].is_alive():
                        raise RankLost(f"learner rank {rank} ({self.handles[rank].describe()}) ended before it "
                                       "joined the group; its error is above") from None
                    if time.monotonic() > deadline:
                        raise RankLost(f"learner rank {rank} did not start within {limit:g} s "
                                       f"({self.handles[rank].describe()})") from None

    def describe_dead(self) -> str:
        dead = [f"rank {r} ({h.describe()})" for r, h in sorted(self.handles.items()) if not h.is_alive()]
        return "; ".join(dead)

    def send(self, kind: str, payload: Any = None) -> None:
        """Command number `sent` to every other rank (they wait for it in turn)."""
        self.sent += 1
        self.store.set(f"{_KEY}cmd/{self.sent - 1}", pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def read_by_all(self) -> None:
        """After a collective: every rank has read every command sent so far, so the store
        need not keep them (a run's minibatches would otherwise pile up in rank 0's memory)."""
        for n in range(self.dropped, self.sent):
            self.store.delete_key(f"{_KEY}cmd/{n}")
        self.dropped = self.sent

    def begin(self, learner: Learner, model_config: dict[str, Any], kwargs: dict[str, Any], watch: str | None,
              whole: WholeState | None = None) -> None:
        """Describe the learner to the other ranks and hand them its state (after a resume's
        restore: every rank starts where rank 0 is); under FSDP2 `whole` is that state, as one
        process holds it (replay_pipeline/run/handover.py)."""
        dtype = next(learner.model.parameters()).dtype
        self.send("start", {"model_config": model_config, "kwargs": kwargs, "watch": watch, "dtype": dtype})
        self.guard("the start's broadcast of the weights", lambda: send_state(learner, whole))
        self.read_by_all()

    def gather(self, learner: Learner, optimizer: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """FSDP2: the whole weights (and with `optimizer` the optimizer state) on rank 0 in the
        one-process format, every other rank joining the gather (handover.gather_state)."""
        self.check_alive(learner)
        self.send("gather", optimizer)
        out = self.guard(f"the gather of the learner's state after learner step {learner.steps}",
                         lambda: gather_state(learner, optimizer))
        self.read_by_all()
        return out

    def round(self, learner: Learner, minibatches: Sequence[dict], policy: ReusePolicy) -> Any:
        """Rank 0's apply_updates with every other rank applying the same minibatches."""
        self.check_alive(learner)
        self.send("round", (list(minibatches), policy))
        out = self.guard(f"learner step {learner.steps}", lambda: apply_updates(learner, minibatches, policy))
        if minibatches:  # its steps' all-reduces were reached by every rank
            self.read_by_all()
        return out

    def check_alive(self, learner: Learner) -> None:
        dead = self.describe_dead()
        if dead:
            self.failed = True
            raise RankLost(f"learner {dead}, before learner step {learner.steps}")

    def guard(self, what: str, body: Callable[[], Any]) -> Any:
        """`body` (collectives), its failure turned into RankLost naming the ranks that died."""
        try:
            return body()
        except RankLost:
            raise
        except Exception as exc:  # gloo: "Connection closed by peer", a timeout...
            self.failed = True
            time.sleep(0.5)  # a rank that died is seen dead a moment later
            dead = self.describe_dead()
            if dead:
                raise RankLost(f"learner {dead}, during {what}") from exc
            raise RankLost(f"{what} failed across the learner's {self.world_size} ranks, none of which exited: one "
                           f"stopped answering within learner.timeout={self.timeout:g} s "
                           f"({' '.join(str(exc).split())[:160]})") from exc

    def close(self) -> None:
        """Tell the other ranks to stop, wait for them (killing any after STOP_GRACE s) and
        leave the process group. Safe to call twice and after a failure."""
        if self.closed:
            return
        self.closed = True
        try:
            self.send("stop")
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass
        deadline = time.monotonic() + (0.0 if self.failed else STOP_GRACE)
        while any(h.is_alive() for h in self.handles.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.on_close is not None:
            self.on_close()

    def kill(self) -> None:
        for handle in self.handles.values():
            if handle.is_alive():
                handle.kill()


# --------------------------------------------------------------------------- the local engine
class RankProcess:
    """A rank as a spawned child process, as LearnerRanks sees it."""

    def __init__(self, process: Any):
        self.process = process

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)

    def describe(self) -> str:
        code = self.process.exitcode
        if code is None:
            return f"process {self.process.pid} alive"
        return f"process {self.process.pid} " + (f"killed by signal {-code}" if code < 0 else f"exited with code {code}")


def launch_processes(ranks: list[int], args_for: Callable[[int], tuple]) -> dict[int, RankProcess]:
    """loop.engine=local: each rank a spawned child of the flow's process (fork can hang torch)."""
    context = multiprocessing.get_context("spawn")
    handles = {}
    for rank in ranks:
        process = context.Process(target=learner_rank, args=(*args_for(rank), os.getpid()),
                                  name=f"learner-rank-{rank}", daemon=True)
        process.start()
        handles[rank] = RankProcess(process)
    return handles
