"""The phases of one device job and the fault hooks inside them (spec §11, §12.2).

prepare/H2D/BF16 on the host -> submit (before_submit) -> device Wait (override_wait)
-> output status (override_status) -> D2H -> sampling (corrupt_output) -> delivery.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from calculet_load.schema import ServerEvent
from calculet_sim import faults as F
from calculet_sim.tokens import EOS

if TYPE_CHECKING:
    from calculet_sim.engine import Engine, Job


# `Engine.unavailable_until_ns` of a device that stays gone until the next reset.
UNTIL_RESET = 2**63 - 1


def _ms_since(t_ns: int) -> float:
    return (time.monotonic_ns() - t_ns) / 1e6


def _shape_of(job: Job) -> str:
    n = job.seqs[0].prompt_len if job.kind == "prefill" else 1
    return f"{job.kind}:{max(n, 1).bit_length()}"


async def run_job(eng: Engine, job: Job) -> None:
    t_start = time.monotonic_ns()
    queue_ms = {s.seq_id: (t_start - s.ready_mono) / 1e6 for s in job.seqs}
    prepare, h2d, bf16 = eng._host_pre_ms(job)
    t0 = time.monotonic_ns()
    await eng.sleep_ms(prepare + h2d + bf16)
    host_pre = _ms_since(t0)
    # Split the measured host time across its phases in the modelled proportions.
    total = prepare + h2d + bf16 or 1.0
    ms = {
        "prepare": host_pre * prepare / total,
        "h2d": host_pre * h2d / total,
        "bf16": host_pre * bf16 / total,
    }
    for seq in job.seqs:
        eng.event(ServerEvent.JOB_PREPARED, seq, job_id=job.job_id, kind=job.kind)
    eng.pending_jobs += 1
    async with eng._device_lock:
        eng.pending_jobs -= 1
        if not await _submit(eng, job):
            return
        eng.left_jobs += 1
        wait_rc, device_ms, stale = _wait_plan(eng, job)
        t_dev = time.monotonic_ns()
        await eng.sleep_ms(device_ms)
        waited = time.monotonic_ns() - t_dev
        eng.busy_ns += waited
        ms["device"] = waited / 1e6
        eng.left_jobs -= 1
        eng.finished_jobs += 1
        for seq in job.seqs:
            eng.event(
                ServerEvent.WAIT_DONE, seq, job_id=job.job_id, kind=job.kind, detail={"rc": wait_rc}
            )
    if eng.metrics is not None:
        eng.metrics.phase_ms.labels("h2d", job.kind).observe(ms["h2d"])
        eng.metrics.phase_ms.labels("infer", job.kind).observe(ms["device"])
    if wait_rc is not None:
        _on_wait_timeout(eng, job, wait_rc)
        return
    if job.generation != eng.generation:
        _on_stale(eng, job, stale)
        return
    if _ccu_exception(eng, job):
        return
    t0 = time.monotonic_ns()
    await eng.sleep_ms(eng.p.timing.d2h_ms)
    ms["d2h"] = _ms_since(t0)
    if eng.metrics is not None:
        eng.metrics.phase_ms.labels("d2h", job.kind).observe(ms["d2h"])
    for seq in job.seqs:
        eng.event(ServerEvent.LOGITS_READY, seq, job_id=job.job_id, kind=job.kind)
    t0 = time.monotonic_ns()
    await eng.sleep_ms(eng.p.timing.sampling_ms_per_lane * len(job.seqs))
    ms["sampling"] = _ms_since(t0)
    nan = _corrupt_output(eng, job)
    if nan is None:
        return
    _deliver(eng, job, ms, queue_ms, nan)


async def _submit(eng: Engine, job: Job) -> bool:
    """before_submit: returns False when the job was not submitted (seqs handled)."""
    sched = eng.p.scheduling
    scale = eng.scale or 1.0
    shape = _shape_of(job)
    for seq in job.seqs:
        eng.event(ServerEvent.SUBMIT_START, seq, job_id=job.job_id, kind=job.kind)
    if shape in eng.isolated_shapes:
        for seq in list(job.seqs):
            eng.fail(seq, 503, "artifact_isolated", f"artifact for shape {shape} is isolated")
        return False
    attempt = 0
    while True:
        rc = None
        if eng.faults.fire("device_busy", scale):
            rc = F.RC_BUSY
        elif time.monotonic_ns() < eng.unavailable_until_ns:
            rc = F.RC_UNAVAILABLE
        elif eng.faults.fire("device_unavailable", scale):
            rc = F.RC_UNAVAILABLE
            eng.unavailable_until_ns = UNTIL_RESET  # a dropped-out device needs a reset
        elif job.kind == "prefill" and (fault := eng.faults.fire("invalid_shape", scale)):
            rc = fault.rc or F.RC_INVALID_SHAPE
        if rc is None:
            break
        eng.counters[f"runtime_rc{rc}"] += 1
        _runtime_error(eng, job, {"rc": rc, "where": "submit", "attempt": attempt})
        if rc == F.RC_BUSY:
            if eng.faults.broken("device_busy"):
                _fail_all(eng, job, 503, "device_busy", "device busy (rc=17)")
                _schedule_reset(eng, "device_busy")
                return False
            if attempt < sched.busy_retries:
                backoff = sched.busy_backoff_ms * 2**attempt
                eng.event(ServerEvent.BACKOFF, None, detail={"rc": rc, "backoff_ms": backoff})
                await eng.sleep_ms(backoff)
                attempt += 1
                continue
            _fail_all(eng, job, 503, "device_busy", "device busy (rc=17) after bounded backoff")
            return False
        if rc == F.RC_UNAVAILABLE:
            _fail_all(eng, job, 503, "device_unavailable", "device unavailable (rc=18)")
            # Broken: keeps admitting and submitting to a device that will not come back.
            if not eng.faults.broken("device_unavailable"):
                if eng.state == "ready":
                    eng.set_state("recovering", "device_unavailable")  # admission stops
                _schedule_reset(eng, "device_unavailable")
            return False
        # rc 21/22: the artifact cannot run this shape/dtype.
        code = "invalid_shape" if rc == F.RC_INVALID_SHAPE else "invalid_dtype"
        _fail_all(eng, job, 500, code, f"artifact rejected the job (rc={rc})")
        if eng.faults.broken("invalid_shape"):
            _schedule_reset(eng, code)
        else:
            eng.isolated_shapes.add(shape)
            eng.event(ServerEvent.ARTIFACT_ISOLATED, None, detail={"shape": shape, "rc": rc})
        return False
    for seq in job.seqs:
        eng.event(ServerEvent.SUBMIT_OK, seq, job_id=job.job_id, kind=job.kind)
    return True


def _wait_plan(eng: Engine, job: Job) -> tuple[int | None, float, bool]:
    """override_wait: (rc, device ms, stale) for this job's Wait."""
    scale = eng.scale or 1.0
    device_ms = eng.device_ms(job)
    if eng.faults.fire("wait_timeout", scale) or eng.faults.fire("repeated_faults", scale):
        return F.RC_TIMEOUT, eng.p.scheduling.wait_timeout_ms, False
    stale = eng.faults.fire("stale_completion", scale)
    if stale is not None:
        # The job is delayed past a reset the runtime performs meanwhile.
        _schedule_reset(eng, "stale_completion_test")
        return None, device_ms + max(stale.delay_ms, eng.p.scheduling.reset_ms * 2), True
    return None, device_ms, False


def _fail_all(eng: Engine, job: Job, status: int, code: str, msg: str, **kw: bool) -> None:
    for seq in list(job.seqs):
        if seq.cancelled and not seq.done:
            eng.release(seq, **kw)
        else:
            eng.fail(seq, status, code, msg, **kw)


def _runtime_error(eng: Engine, job: Job, detail: dict[str, Any]) -> None:
    """A runtime error of the job, recorded against each of its sequences."""
    for seq in job.seqs:
        eng.event(ServerEvent.RUNTIME_ERROR, seq, job_id=job.job_id, kind=job.kind, detail=detail)


def _schedule_reset(eng: Engine, reason: str) -> None:
    from calculet_sim.lifecycle import reset, spawn

    spawn(reset(eng, reason))


def _on_wait_timeout(eng: Engine, job: Job, rc: int) -> None:
    eng.counters["runtime_rc13"] += 1
    _runtime_error(eng, job, {"rc": rc, "where": "wait"})
    broken = eng.faults.broken("wait_timeout") or eng.faults.broken("repeated_faults")
    # Designed: the buffers the device may still write are quarantined, never reused.
    _fail_all(eng, job, 504, "wait_timeout", "device Wait timed out (rc=13)", quarantine=not broken)
    _schedule_reset(eng, "wait_timeout")


def _on_stale(eng: Engine, job: Job, stale: bool) -> None:
    broken = eng.faults.broken("stale_completion")
    detail = {"job_generation": job.generation, "current_generation": eng.generation}
    if not broken:
        eng.event(ServerEvent.STALE_COMPLETION_BLOCKED, None, job_id=job.job_id, detail=detail)
        _fail_all(eng, job, 503, "device_reset", "job belonged to a previous generation")
        return
    # Broken: the stale result is written into whatever now holds those buffers.
    eng.event(ServerEvent.STALE_COMPLETION_DELIVERED, None, job_id=job.job_id, detail=detail)
    victims = [s for s in eng.active.values() if not s.busy]
    for seq in victims[:1]:
        seq.shared_lease = True
    _fail_all(eng, job, 503, "device_reset", "job belonged to a previous generation")


def _ccu_exception(eng: Engine, job: Job) -> bool:
    """override_status: a CCU exception; True when the job's logits were withheld."""
    fault = eng.faults.fire("ccu_exception", eng.scale or 1.0)
    if fault is None:
        return False
    eng.counters["ccu_exception"] += 1
    _runtime_error(eng, job, {"status": "ccu_exception", "where": "output_status"})
    if fault.broken:
        # Broken: garbage logits are delivered and nothing recovers.
        for seq in job.seqs:
            seq.shared_lease = True
        return False
    _fail_all(eng, job, 500, "ccu_exception", "CCU exception: logits not delivered")
    _schedule_reset(eng, "ccu_exception")
    return True


def _corrupt_output(eng: Engine, job: Job) -> bool | None:
    """corrupt_output + numeric check: None when the job failed the check."""
    scale = eng.scale or 1.0
    fault = eng.faults.fire("output_nan", scale)
    knob = eng.p.knobs.nan_probability
    if fault is None and not (knob and eng.rng.random() < knob):
        return False
    if fault is not None and not fault.broken:
        for seq in job.seqs:
            eng.event(ServerEvent.NUMERIC_CHECK_FAILED, seq, job_id=job.job_id, kind=job.kind)
        _fail_all(eng, job, 500, "numeric_check_failed", "NaN/Inf in logits")
        return None
    return True  # broken (or the NaN knob): NaN reaches a success response


def _deliver(
    eng: Engine, job: Job, ms: dict[str, float], queue_ms: dict[int, float], nan: bool
) -> None:
    for seq in job.seqs:
        if seq.done:
            if seq.cancelled:
                continue
            # Freed while the device still wrote into it (broken cancel_submitted).
            eng.event(ServerEvent.RUNTIME_ERROR, seq, job_id=job.job_id, detail={"rc": "uaf"})
            continue
        tok = eng.token_for(seq)
        step = seq.n_generated
        eng.event(ServerEvent.SAMPLED, seq, job_id=job.job_id, kind=job.kind, step_index=step)
        if seq.cancelled:
            continue  # drained; the result is not delivered
        if eng.traces.enabled("steps"):
            kv_after = seq.prompt_len + step
            # a prefill starts from the prompt's cached prefix
            kv_before = seq.cached_tokens if job.kind == "prefill" else kv_after - 1
            row_ms = dict(ms, queue=queue_ms[seq.seq_id])
            eng.traces.write("steps", eng.step_row(job, seq, row_ms, step, kv_before, kv_after))
        if job.kind == "prefill":
            eng.cache_prompt(seq)
        if tok == EOS:
            eng.finish(seq, "stop")
            continue
        seq.n_generated += 1
        seq.ids.append(tok)
        seq.out.put_nowait(("token", tok, step, nan))
        if seq.n_generated >= seq.max_new:
            eng.finish(seq, "length")
            continue
        if job.kind == "prefill":
            eng._prefill.remove(seq)
            eng._ring.append(seq)
            seq.state = "decode"
        seq.ready_mono = time.monotonic_ns()
