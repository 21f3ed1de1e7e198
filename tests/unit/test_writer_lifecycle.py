"""The writer's lifetime: dropped without close(), Ctrl-C inside save(), calls from the wrong thread."""

from __future__ import annotations

import _thread
import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

import checkpointd
from checkpointd import CheckpointWriter, SaveHandle
from checkpointd.write.capture import StagingBuffer
from checkpointd.write.loop import InProcessBackend
from tests.support.gates import OnLoop, hold_local_writes


def _state(value: float = 1.0) -> dict[str, object]:
    return {"model": {"w": torch.full((64,), value)}}


def _steps(root: Path) -> list[int]:
    return [c.step for c in checkpointd.list_checkpoints(str(root))]


# --- a writer dropped without close() -------------------------------------------------


def _new_writer(root: Path) -> tuple[CheckpointWriter, threading.Thread]:
    """A writer and the event-loop thread it started."""
    before = set(threading.enumerate())
    writer = CheckpointWriter(str(root))
    (loop_thread,) = set(threading.enumerate()) - before
    return writer, loop_thread


def _save_and_drop(root: Path) -> tuple[SaveHandle, threading.Thread]:
    """Save with a writer held only here; return the handle and the writer's loop thread."""
    writer, loop_thread = _new_writer(root)
    return writer.save(3, _state()), loop_thread


def test_dropped_writer_warns_and_still_commits_its_pending_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_local_writes(monkeypatch)
    # The writer dies when _save_and_drop returns (or at the collection, if in a cycle).
    with pytest.warns(ResourceWarning, match=r"dropped without close\(\).*1 save"):  # noqa: PT031
        handle, loop_thread = _save_and_drop(tmp_path)
        gc.collect()
    assert not handle.done()
    gate.set()
    assert handle.result(timeout=60).step == 3  # before the fix: WriterClosedError
    loop_thread.join(60)
    assert not loop_thread.is_alive()  # the dropped writer closed itself once done
    assert _steps(tmp_path) == [3]


def test_dropped_writer_without_handle_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_local_writes(monkeypatch)
    with pytest.warns(ResourceWarning):  # noqa: PT031 - as above
        _, loop_thread = _save_and_drop(tmp_path)
        gc.collect()
    gate.set()
    loop_thread.join(60)
    assert not loop_thread.is_alive()
    assert _steps(tmp_path) == [3]


def test_dropped_idle_writer_is_closed_quietly(tmp_path: Path) -> None:
    writer, loop_thread = _new_writer(tmp_path)
    writer.save(1, _state()).result(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del writer
        gc.collect()
    loop_thread.join(60)
    assert not loop_thread.is_alive()


def test_writer_dropped_by_a_returning_function_commits_before_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import checkpointd, torch

        def train():
            writer = checkpointd.CheckpointWriter({str(tmp_path)!r})
            for step in (100, 200, 300):
                writer.save(step, {{"m": {{"w": torch.full((1000,), float(step))}}}})

        train()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode == 0, done.stderr
    assert _steps(tmp_path) == [100, 200, 300]  # before the fix: [100, 200], 300 lost
    assert checkpointd.load(str(tmp_path)).state["m"]["w"][0].item() == 300.0


# --- Ctrl-C while save() waits for a staging buffer ------------------------------------


def _main_blocks_in_the_buffer_wait() -> bool:
    """True when the main thread is asleep in save()'s wait for a buffer: its Python stack
    is in call_interruptibly's wait (past start_task_soon) and the kernel has it sleeping,
    twice, 5 ms apart. Only then is a signal sure to wake it (or to run once it has the
    GIL): one sent as it starts to block is seen by CPython only when the wait ends."""
    main = threading.main_thread()
    stat = Path(f"/proc/self/task/{main.native_id}/stat")
    for _ in range(2):
        frame = sys._current_frames().get(main.ident)  # noqa: SLF001 - the only accessor
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        waiting = names[:1] == ["wait"] and "call_interruptibly" in names
        if not waiting or "start_task_soon" in names:
            return False
        if stat.read_text().rsplit(")", 1)[1].split()[0] != "S":
            return False
        time.sleep(0.005)
    return True


def _interrupt_main_once_save_waits(
    monkeypatch: pytest.MonkeyPatch, interrupt: Callable[[], None], gate: threading.Event
) -> threading.Thread:
    """From a helper thread: ``interrupt()`` the main thread once the second save() is
    blocked waiting for a buffer (the writer has one, held by the first save). If the
    test has not opened ``gate`` 20 s later, open it: the interrupt was not seen."""
    asked = threading.Event()
    real = InProcessBackend.acquire_buffer
    calls = 0

    async def acquire_buffer(service: InProcessBackend) -> StagingBuffer:
        nonlocal calls
        calls += 1
        if calls == 2:
            asked.set()
        return await real(service)

    monkeypatch.setattr(InProcessBackend, "acquire_buffer", acquire_buffer)

    def run() -> None:
        if not asked.wait(60):
            return
        # Not at once: main may still be on its way into the wait (see above).
        deadline = time.monotonic() + 60
        while not _main_blocks_in_the_buffer_wait() and time.monotonic() < deadline:
            time.sleep(0.001)
        interrupt()
        if not gate.wait(20):
            gate.set()  # lets the first save end, and with it the second one's wait

    helper = threading.Thread(target=run)
    helper.start()
    return helper


def _sigint() -> None:
    """A Ctrl-C: SIGINT to the main thread (it wakes a blocking wait)."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signal.SIGINT)


def _late_sigint() -> None:
    """A Ctrl-C whose SIGINT landed as the main thread began to block: the handler is due
    but nothing wakes the wait (what _thread.interrupt_main does)."""
    _thread.interrupt_main()


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
@pytest.mark.parametrize("interrupt", [_sigint, _late_sigint], ids=["sigint", "late-sigint"])
def test_ctrl_c_while_save_waits_for_a_buffer_leaves_the_writer_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: Callable[[], None]
) -> None:
    # Python's own Ctrl-C handler, whatever this process inherited: a shell starts a
    # background job (`cmd &` without job control, as CI scripts may) with SIGINT
    # ignored, and then no Ctrl-C reaches Python at all.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    gate = hold_local_writes(monkeypatch)
    writer = CheckpointWriter(str(tmp_path), max_pending=1)
    helper = _interrupt_main_once_save_waits(monkeypatch, interrupt, gate)
    try:
        first = writer.save(1, _state(1.0))  # holds the only buffer until the gate opens
        with pytest.raises(KeyboardInterrupt):
            writer.save(2, _state(2.0))
        # Seen while it waited: before the fix a late one came only once step 1 had
        # freed the buffer (here: once the helper gave up and opened the gate).
        assert not gate.is_set(), "the Ctrl-C was seen only once the held save ended"
        gate.set()
        helper.join()
        assert first.result(timeout=60).step == 1
        # The "save a last checkpoint on Ctrl-C" save: before the fix it waited forever
        # for the buffer the interrupted call had taken anyway.
        last: list[checkpointd.CheckpointInfo] = []
        saver = threading.Thread(target=lambda: last.append(writer.save(2, _state(2.0)).result(60)))
        saver.start()
        saver.join(30)
        assert last, "the next save() was blocked: the buffer leaked"
        assert last[0].step == 2
    finally:
        gate.set()  # nothing left held: close() (and a failed test) cannot wait on it
        helper.join()
        writer.close()
        signal.signal(signal.SIGINT, previous)
    assert _steps(tmp_path) == [1, 2]
    assert checkpointd.load(str(tmp_path), 2).state["model"]["w"][0].item() == 2.0


# --- calls from the writer's own event-loop thread -------------------------------------


def test_result_on_the_sync_writers_loop_thread_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_local_writes(monkeypatch)
    on_loop = OnLoop(monkeypatch)
    with CheckpointWriter(str(tmp_path), max_pending=2) as writer:
        handle = writer.save(1, _state())
        on_loop.queued.append(lambda: handle.result(5))
        writer.save(2, _state())  # runs it on the loop thread while step 1 is pending
        (refused,) = on_loop.outcomes
        assert isinstance(refused, checkpointd.WrongThreadError)
        assert "event loop thread" in str(refused)
        gate.set()
        assert handle.result(timeout=60).step == 1
        on_loop.queued.append(handle.result)
        writer.save(3, _state())
        assert on_loop.outcomes[1].step == 1  # resolved: fine on any thread


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_result_on_the_loop_thread_raises_instead_of_deadlocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    gate = hold_local_writes(monkeypatch)

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path)) as writer:
            handle = await writer.save(1, _state())
            # Before the fix: blocks the loop that would resolve it (here: TimeoutError).
            with pytest.raises(checkpointd.CheckpointError, match=r"await handle\.wait") as error:
                handle.result(timeout=5)
            assert error.type.__name__ == "WrongThreadError"
            gate.set()
            assert (await handle.wait()).step == 1
            assert handle.result().step == 1

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_wait_takes_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    gate = hold_local_writes(monkeypatch)

    async def main() -> None:
        async with checkpointd.AsyncCheckpointWriter(str(tmp_path)) as writer:
            handle = await writer.save(1, _state())
            with pytest.raises(TimeoutError, match=r"still running after 0\.2s"):
                await writer.wait(timeout=0.2)
            assert not handle.done()  # the save goes on
            gate.set()
            await writer.wait(timeout=60)
            assert handle.done()

    anyio.run(main, backend=backend)
    assert _steps(tmp_path) == [1]
