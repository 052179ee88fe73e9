"""Slots of Prefect's global concurrency limits held under leases that outlive a Prefect server restart.

Why this module exists (gpus.py says why the pool is built on these limits at all): Prefect 3 counts a
limit's active slots in its database but keeps the leases that hold them in the server's lease storage, which is
the server's memory unless the server sets PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE. A restart then forgets every
lease and keeps every count: renewals get `410 Gone`, a release finds no lease and frees nothing, and the
repossessor, which frees only expired leases that it knows, never frees them, so the pool shrinks for good.
Prefect's own `concurrency()` also stops renewing after three failed attempts, a few seconds, so even a server
that keeps its leases (Prefect's filesystem lease storage) lets a training's lease lapse during a restart longer
than that, and its GPU is handed to another run. Prefect offers no API that lists the leases of a global limit,
so the client cannot compare counts with leases directly; what it can see is whether the server still knows one
lease of its own. Hence two parts, both on Prefect's API:

- `hold`: acquire with a lease (waiting in the calling thread, so SIGTERM ends the wait at once), renew it every
  RENEW_SECONDS from a daemon thread for as long as the server takes to come back, and release it at the end. A
  lease the server no longer knows is re-claimed on the same limits; where that fails because another run holds
  them now, the run stops (SIGTERM to itself: Crashed, hooks, resumable) rather than share a GPU.
- the pool's sentinel (`check_server_leases`): one long lease on SENTINEL_LIMIT, named in the Prefect variable
  EPOCH_VARIABLE and renewed by every holder, waiting run and `setup`. When the server no longer knows it, the
  server lost its leases, so every count of the pool's limits (`qlora-*`) is stale: exactly one process (the one
  that creates the variable RESET_PREFIX + the lost sentinel's id) sets them to 0, says which it repaired, and
  starts a new sentinel; for GRACE_SECONDS after that, only runs that held slots before may take slots (they
  re-claim theirs), so no new run is placed on a GPU that a running training still uses.

Limits: clocks of the hosts are compared for the grace period (seconds of skew only shorten or lengthen it). A
lease taken on the restarted server before anyone checked the sentinel (every acquisition checks it first, so
only within the same instant) would be zeroed with the rest, and its limit would count one holder too few until
it is released. A training that cannot reach the server for longer than a lease (60 s) while the server keeps
running is repossessed by Prefect like a killed run; it re-claims its GPUs when it reaches the server again, or
stops if they were handed out meanwhile. With Prefect's filesystem lease storage (`setup` says which one the
server uses) a restart forgets nothing and the sentinel is never lost; the holders' renewals then only have to
outlast the outage, and those of runs that died meanwhile lapse and are freed by Prefect's repossessor.
"""

from __future__ import annotations

import contextvars
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from tasks.errors import UserError
from tasks.log import logger

LEASE_SECONDS = 60  # the shortest lease Prefect's server accepts: a killed run's slots return within it
RENEW_SECONDS = LEASE_SECONDS / 4  # renewed with 45 s left: a server away for less than that costs nothing
RETRY_SECONDS = 2.0  # while the server is away or the slots are taken (at most; the server may ask for less)
GRACE_SECONDS = LEASE_SECONDS  # after a repair, the runs that held slots have this long to re-claim them
POOL_PREFIX = "qlora-"  # the GPU pool's limits and the CPU counter (gpus.py, cpus.py): what a repair resets
SENTINEL_LIMIT = "qlora-gpu-leases"  # 1 slot, held by the sentinel lease while the server keeps its leases
SENTINEL_SECONDS = 86_400  # the longest lease Prefect grants; every holder renews it
EPOCH_VARIABLE = "qlora_gpu_leases"  # {"sentinel": lease id, "repaired_at": time.time() of the last repair}
RESET_PREFIX = "qlora_gpu_leases_reset_"  # + the lost sentinel's id: created once, by the process that repairs


def uses_server() -> bool:
    """True when runs go to a Prefect server (PREFECT_API_URL), where several runs can compete for the GPU.

    A run without one gets a temporary server of its own, which no other run shares; taking the slot there
    guards nothing, and on that SQLite-backed temporary server it was seen to block the run indefinitely.
    """
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    # the API `qlora-pipeline run` serves itself (deployments/temporary_server.py) is as temporary as Prefect's own
    return bool(url) and url != os.environ.get("QLORA_TEMPORARY_API_URL")


def is_pool_limit(name: str) -> bool:
    return name.startswith(POOL_PREFIX)


class SlotsLost(RuntimeError):
    """A held lease was lost and its slots were taken by another run before they could be re-claimed."""


@contextmanager
def hold(name: str, slots: int, *, strict: bool, critical: bool, holder: UUID | None = None,
         on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold `slots` slots of the limit `name` while in the block; yields False when the limit does not exist and
    `strict` is off (nothing held). `on_wait` is called once, when the slots are taken and the run starts waiting.
    `critical`: a lost lease that cannot be re-claimed stops the run (GPU limits); else it is logged (counters).
    """
    with hold_first([(name,)], slots, strict=strict, critical=critical, holder=holder, on_wait=on_wait) as names:
        yield names is not None


@contextmanager
def hold_first(choices: list[tuple[str, ...]], slots: int, *, strict: bool, critical: bool, holder: UUID | None = None,
               on_wait: Callable[[], None] | None = None) -> Iterator[tuple[str, ...] | None]:
    """Hold `slots` slots of every limit of one of `choices` while in the block, all under one lease: the first
    choice whose limits all have them free, taken in one step by Prefect's bulk acquisition (all or nothing: a
    waiting run holds no slot of any of them). Yields the choice held; None when a limit does not exist and `strict`
    is off. The rest as `hold`."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        got = _acquire(client, choices, slots, holder, on_wait, reclaim=False, critical=critical)
    if got is None:
        if strict:
            named = ", ".join(repr(n) for n in dict.fromkeys(n for names in choices for n in names))
            raise UserError(f"A global concurrency limit of {named} does not exist on this Prefect server; run "
                            "`qlora-pipeline setup` once (on each host, with --host).")
        yield None
        return
    names, lease = got
    keeper = _Keeper(names, slots, holder, lease, critical)
    try:
        yield names
    finally:
        keeper.release()


class _Keeper:
    """Renews one lease from a daemon thread until released; re-claims it when the server no longer knows it."""

    def __init__(self, names: tuple[str, ...], slots: int, holder: UUID | None, lease: UUID, critical: bool) -> None:
        self.names, self.slots, self.holder, self.lease, self.critical = names, slots, holder, lease, critical
        self.name = ", ".join(names)  # as said in the log
        self.stop = threading.Event()
        self.lock = threading.Lock()  # the lease id changes on a re-claim; release reads it
        context = contextvars.copy_context()  # the run's logger in the thread
        self.thread = threading.Thread(target=context.run, args=(self._renew_until_released,), daemon=True,
                                       name=f"lease-{self.name}")
        self.thread.start()

    def _renew_until_released(self) -> None:
        from prefect import get_client

        wait = RENEW_SECONDS
        with _no_client_retries(), get_client(sync_client=True) as client:
            while not self.stop.wait(wait):
                try:
                    check_server_leases(client)
                    with self.lock:
                        if not self.stop.is_set() and not _renew(client, self.lease, LEASE_SECONDS):
                            self._reclaim(client)
                    wait = RENEW_SECONDS
                except SlotsLost as exc:
                    return _stop_run(str(exc))
                except Exception as exc:  # noqa: BLE001 - the server away: keep trying until it is back
                    logger().debug("lease of %r not renewed yet (%s); retrying", self.name, exc)
                    wait = RETRY_SECONDS

    def _reclaim(self, client: Any) -> None:
        """The server no longer knows the lease: its slots are free (repaired or expired); take them again."""
        got = _acquire(client, [self.names], self.slots, self.holder, None, reclaim=True, critical=self.critical)
        lease = got[1] if got else None
        if lease is None and self.critical:
            raise SlotsLost(f"this run lost its lease on the global concurrency limit {self.name!r} while the "
                            f"Prefect server was away, and another run holds those slots now: stopping it so that "
                            f"two trainings do not share a GPU. Run it again: training resumes from its latest "
                            f"complete checkpoint.")
        if lease is None:
            logger().warning("the lease on %r was lost and could not be re-claimed; that limit counts this run no "
                             "longer", self.name)
            self.lease = None
            self.stop.set()
            return
        logger().warning("the Prefect server no longer knew this run's lease on %r (a restart?); re-claimed its "
                         "%d slot(s)", self.name, self.slots)
        self.lease = lease

    def release(self) -> None:
        from prefect import get_client

        self.stop.set()
        with self.lock:  # not while a renewal or re-claim is under way
            lease = self.lease
        self.thread.join(timeout=5)
        if lease is None:
            return
        deadline = time.monotonic() + 5 * RETRY_SECONDS  # beyond it the lease lapses, or a repair frees it
        with _no_client_retries(), get_client(sync_client=True) as client:
            while True:
                try:
                    client.release_concurrency_slots_with_lease(lease_id=lease)
                    return
                except Exception as exc:  # noqa: BLE001 - the server away: the lease lapses or is repaired
                    if time.monotonic() > deadline:
                        logger().warning("could not release the lease on %r (%s): the server frees it within %d "
                                         "s of being back", self.name, exc, LEASE_SECONDS)
                        return
                    time.sleep(RETRY_SECONDS)


def _no_client_retries() -> Any:
    """Prefect's client retries a refused connection for about a minute before it gives up; the renewals here try
    every RETRY_SECONDS themselves, so that a lease is renewed or re-claimed within seconds of the server's return
    (inside the grace period after a repair), and a release does not hold up a stopping process."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    return temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0})


def _acquire(client: Any, choices: list[tuple[str, ...]], slots: int, holder: UUID | None,
             on_wait: Callable[[], None] | None, reclaim: bool, critical: bool) -> tuple[tuple[str, ...], UUID] | None:
    """A new lease on `slots` slots of each limit of the first of `choices` that has them free, and that choice;
    waiting while none has (a re-claim: one attempt). None when a limit does not exist, or when a re-claim finds the
    slots taken. A critical limit (a GPU's) waits out the grace period after a repair, unless this is a re-claim."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    who = ConcurrencyLeaseHolder(type="task_run", id=holder) if holder else None
    name = " or ".join(", ".join(names) for names in choices)  # as said in the log
    while True:
        taken = True
        try:
            grace = check_server_leases(client)
            if reclaim or not critical or grace <= 0:
                for names in choices:  # 423 (taken): the next choice; the last one's 423 waits below
                    try:
                        lease = _lease(client, names, slots, who)
                    except Exception as exc:
                        if names is choices[-1] or getattr(getattr(exc, "response", None), "status_code", 0) != 423:
                            raise
                        continue
                    return (names, lease) if lease is not None else None
            delay = min(grace, RETRY_SECONDS)  # the runs that held slots before the repair re-claim them first
        except Exception as exc:  # noqa: BLE001 - 423: taken; 5xx or no answer: the server away, wait for it
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status is not None and status != 423 and status < 500:
                raise
            if status == 423 and reclaim:
                return None
            taken = status == 423
            delay = min(float(exc.response.headers.get("Retry-After", RETRY_SECONDS)), RENEW_SECONDS) if taken \
                else RETRY_SECONDS
            if not taken:
                logger().debug("acquiring %r: the Prefect server is away (%s); retrying", name, exc)
        if taken and on_wait is not None:
            on_wait()
            on_wait = None
        time.sleep(delay)  # in the caller's thread: SIGTERM ends the wait here


def _lease(client: Any, names: tuple[str, ...], slots: int, holder: Any, seconds: float = LEASE_SECONDS) -> UUID | None:
    response = client.increment_concurrency_slots_with_lease(names=list(names), slots=slots, mode="concurrency",
                                                             lease_duration=seconds, holder=holder)
    body = response.json()
    if len(body["limits"]) < len(set(names)):  # a limit missing: Prefect grants a lease on the others; give it back
        client.release_concurrency_slots_with_lease(lease_id=body["lease_id"])
        return None
    return UUID(body["lease_id"])


def _renew(client: Any, lease: UUID, seconds: float) -> bool:
    """Renew `lease`; False when the server no longer knows it (410), errors otherwise."""
    try:
        client.renew_concurrency_lease(lease_id=lease, lease_duration=seconds)
        return True
    except Exception as exc:
        if getattr(getattr(exc, "response", None), "status_code", None) == 410:
            return False
        raise


def check_server_leases(client: Any) -> float:
    """Renew the pool's sentinel; where the server lost it, repair the pool (once, whichever process gets there
    first). Seconds left of the grace period after the last repair, in which only re-claims take GPU slots."""
    return _check(client, say=True)[0]


def repair_pool(client: Any) -> list[str]:
    """check_server_leases for `setup`, which says it itself: what this call repaired ('qlora-gpu 1 -> 0', ...)."""
    return _check(client, say=False)[1]


def _check(client: Any, say: bool) -> tuple[float, list[str]]:
    while True:
        epoch = _epoch(client)
        if epoch is not None and _renew(client, UUID(epoch["sentinel"]), SENTINEL_SECONDS):
            return GRACE_SECONDS - (time.time() - (epoch.get("repaired_at") or 0.0)), []
        lost = epoch["sentinel"] if epoch else "none"
        if _claim_repair(client, lost):
            break
        _await_repair(client, lost)
    repaired = _zero_counts(client)
    _new_sentinel(client, repaired, lost, previous=(epoch or {}).get("token"))
    if not repaired:
        return 0.0, []
    if say:
        logger().warning("the Prefect server no longer knew the GPU pool's leases (restarted without durable "
                         "lease storage?); set active slots to 0: %s. Runs that still hold slots re-claim them within "
                         "%d s", "; ".join(repaired), GRACE_SECONDS)
    return GRACE_SECONDS, repaired


def _epoch(client: Any) -> dict[str, Any] | None:
    """EPOCH_VARIABLE's value; None where it is missing or not ours (then the pool is repaired as after a loss)."""
    variable = client.read_variable_by_name(EPOCH_VARIABLE)
    value = variable.value if variable is not None else None
    try:
        UUID(str(value["sentinel"]))  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    return value  # type: ignore[return-value]


def _token(lost: str) -> str:
    return RESET_PREFIX + lost.replace("-", "")


def _claim_repair(client: Any, lost: str) -> bool:
    """True for exactly one caller per lost sentinel: Prefect creates a variable name once."""
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectAlreadyExists

    try:
        client.create_variable(VariableCreate(name=_token(lost), value=time.time()))
    except ObjectAlreadyExists:
        return False
    return True


def _await_repair(client: Any, lost: str) -> None:
    """Wait until another process has repaired the pool; take over from one that died half-way."""
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + LEASE_SECONDS
    while (_epoch(client) or {}).get("sentinel", "none") == lost:
        if time.monotonic() > deadline:
            try:
                client.delete_variable_by_name(_token(lost))
            except ObjectNotFound:  # another waiting process took over first
                pass
            return
        time.sleep(0.5)


def _zero_counts(client: Any) -> list[str]:
    """Set every pool limit's active slots to 0; what was changed."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    repaired = []
    for limit in client.read_global_concurrency_limits(limit=200):
        if is_pool_limit(limit.name) and limit.active_slots:
            client.update_global_concurrency_limit(limit.name, GlobalConcurrencyLimitUpdate(active_slots=0))
            if limit.name != SENTINEL_LIMIT:  # the lost sentinel's own slot is no news
                repaired.append(f"{limit.name} {limit.active_slots} -> 0")
    return repaired


def _new_sentinel(client: Any, repaired: list[str], lost: str, previous: str | None) -> None:
    """Take the new sentinel lease and name it in EPOCH_VARIABLE; drop the repair token of the epoch before the
    lost one (the lost one's stays: a process that read the old epoch must find the repair done)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, VariableCreate, VariableUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:  # looked up first: a create that collides makes the server log an IntegrityError with its traceback (an
        # ephemeral server prints it in this process: `setup` run twice without a server showed one)
        client.read_global_concurrency_limit_by_name(SENTINEL_LIMIT)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=SENTINEL_LIMIT, limit=1))
        except ObjectAlreadyExists:  # another process created it meanwhile
            pass
    sentinel = _lease(client, (SENTINEL_LIMIT,), 1, None, SENTINEL_SECONDS)
    value = {"sentinel": str(sentinel), "repaired_at": time.time() if repaired else None, "repaired": repaired,
             "token": _token(lost)}
    try:
        client.create_variable(VariableCreate(name=EPOCH_VARIABLE, value=value))
    except ObjectAlreadyExists:
        client.update_variable(VariableUpdate(name=EPOCH_VARIABLE, value=value))
    if previous and previous != _token(lost):
        try:
            client.delete_variable_by_name(previous)
        except ObjectNotFound:
            pass


def _stop_run(reason: str) -> None:
    """Stop this run as a SIGTERM would (Crashed, hooks, exit 143): its GPU belongs to another run now."""
    logger().error("%s", reason)
    os.kill(os.getpid(), signal.SIGTERM)
