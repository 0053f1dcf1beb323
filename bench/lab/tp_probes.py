"""bench_tp's step profiling: torch.profiler on rank 0 over a few decode steps, each step and
decoder layer marked by a record_function range (RANGES), and the events sorted into
collectives (NCCL and peer all-reduce kernels on GPU, gloo ops on CPU), step messages and
kernels per step and per layer (analyze)."""
from __future__ import annotations

import bisect
import gc
import statistics
import time

import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.dist.lockstep import STEP_MESSAGE


class StepProfiler:
    """torch.profiler over `n` engine steps: a "tp_step" range per step, a "tp_layer" range
    per decoder layer call (forward hooks on rank 0's layers, removed on stop)."""

    def __init__(self, model, device: str, n: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        self.prof = profile(activities=acts)
        self.model, self.device, self.left = model, device, n
        self.hooks: list = []
        self.ranges: list = []
        self.done = False
        self.report: dict | None = None

    def start(self) -> None:
        def pre(*_: object) -> None:
            r = torch.autograd.profiler.record_function("tp_layer")
            r.__enter__()
            self.ranges.append(r)

        def post(*_: object) -> None:
            self.ranges.pop().__exit__(None, None, None)

        for layer in self.model.layers:
            self.hooks += [layer.register_forward_pre_hook(pre),
                           layer.register_forward_hook(post)]
        self.prof.start()

    def step(self, engine) -> list:
        with torch.autograd.profiler.record_function("tp_step"):
            outs = engine.step()  # ends in the sampler's host copy: the step's work is done
        self.left -= 1
        if self.left == 0:
            self.stop()
        return outs

    def stop(self) -> None:
        """Analyze and drop the events, then collect: the profiler's garbage would otherwise
        land a long full collection in a measured step."""
        if self.done:
            return
        self.done = True
        if self.hooks:
            self.prof.stop()
            for h in self.hooks:
                h.remove()
            self.report = analyze(self.prof.events(), self.model.config.num_layers, self.device)
        self.prof = None
        gc.collect()


def run_steps(engine, prompts: list[list[int]], max_tokens: int, profile_n: int = 0,
              ) -> tuple[list[dict], dict | None]:
    """bench_engine.drive, plus `profile_n` profiled steps once every request has its first
    token and one more decode step ran (marked "profiled": left out of rates)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params)[0] for p in prompts]
    started: set[str] = set()
    steps: list[dict] = []
    runner = engine.runner
    sp = StepProfiler(runner.model, runner.device.type, profile_n) if profile_n else None
    t = time.perf_counter()
    while engine.has_unfinished():
        all_in = len(started) == len(rids)
        on = sp is not None and not sp.done and all_in and steps[-1]["decode"]
        if on and not sp.hooks:
            sp.start()
        outs = sp.step(engine) if on else engine.step()
        now = time.perf_counter()
        started.update(o.request_id for o in outs if o.new_token_ids)
        steps.append({"s": now - t, "tokens": sum(len(o.new_token_ids) for o in outs),
                      "decode": all_in, "profiled": on})
        t = time.perf_counter()
    if sp is None:
        return steps, None
    sp.stop()
    return steps, sp.report


RANGES = ("tp_step", "tp_layer")  # StepProfiler's record_function names


def _count_in(starts: list[float], lo: float, hi: float) -> int:
    return bisect.bisect_left(starts, hi) - bisect.bisect_left(starts, lo)


def analyze(events, num_layers: int, device: str) -> dict:
    """Per profiled step: collective time and calls, step messages, kernels; per layer call:
    kernel launches and collective calls inside its range (median over calls)."""
    from collections import Counter

    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    steps = [e for e in cpu if e.name == "tp_step"]  # (the GPU copies of the ranges: out)
    n = max(1, len(steps))
    layers = [e for e in cpu if e.name == "tp_layer"]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in RANGES
               and not e.name.startswith(("Memcpy", "Memset"))]
    # NCCL's kernels, and the one-shot peer all-reduce's inside graphs (engine/dist/
    # peer_all_reduce.py: kernels/push_all_reduce.py)
    nccl = [k for k in kernels if "nccl" in k.name.lower() or "all_reduce" in k.name.lower()]
    ops = [e for e in cpu if e.name.startswith(("gloo:", "nccl:"))]
    coll_ops = [e for e in ops if "broadcast" not in e.name]  # the forward's collectives
    control = [e for e in cpu if e.name == STEP_MESSAGE]  # lockstep messages (step channel)

    def ms(xs) -> float:
        return sum(x.time_range.end - x.time_range.start for x in xs) / n / 1e3

    timed = nccl if device == "cuda" else coll_ops
    launch_at = sorted(e.time_range.start for e in cpu if "LaunchKernel" in e.name)
    coll_at = sorted(e.time_range.start for e in coll_ops)
    spans = [(r.time_range.start, r.time_range.end) for r in layers]
    step_ms = [(s.time_range.end - s.time_range.start) / 1e3 for s in steps]
    out = {"steps": len(steps), "step_ms_median": statistics.median(step_ms) if step_ms else None,
           "collective_ms_per_step": ms(timed),
           "collective_pct_of_step": 100 * ms(timed) / statistics.median(step_ms)
           if step_ms else None,
           "collectives_by_name_per_step": {k: v / n for k, v in Counter(
               x.name[:60] for x in timed).items()},
           "step_message_ms_per_step": ms(control), "step_messages_per_step": len(control) / n,
           "kernels_per_step": len(kernels) / n if device == "cuda" else None,
           # a graph replay launches no kernel from a layer's call: count them per step
           # (embedding, LM head and sampling included) over the decoder layers
           "kernels_per_step_over_layers": len(kernels) / n / num_layers
           if device == "cuda" else None,
           "kernel_busy_ms_per_step": ms(kernels) if device == "cuda" else None,
           "kernels_by_name_per_step": {k: v / n for k, v in Counter(
               k.name[:60] for k in kernels).most_common(16)},
           # device time by kernel name (with PDL a kernel's span starts at its early launch,
           # so it includes its wait for the kernel before), and the time any kernel ran
           "kernel_ms_by_name_per_step": _ms_by_name(kernels, n) if device == "cuda" else None,
           "kernel_union_ms_per_step": _union_ms(kernels) / n if device == "cuda" else None,
           "layer_calls": len(layers), "num_layers": num_layers}
    if spans:
        out["per_layer"] = {
            "kernel_launches": statistics.median(_count_in(launch_at, a, b) for a, b in spans)
            if device == "cuda" else None,
            "collective_calls": statistics.median(_count_in(coll_at, a, b) for a, b in spans)}
    out["method"] = METHOD
    return out


def _ms_by_name(kernels, n: int) -> dict[str, float]:
    from collections import Counter

    total: Counter = Counter()
    for k in kernels:
        total[k.name[:60]] += (k.time_range.end - k.time_range.start) / 1e3
    return {k: round(v / n, 4) for k, v in total.most_common(16)}


def _union_ms(kernels) -> float:
    """Milliseconds in which at least one of the kernels ran."""
    spans = sorted((k.time_range.start, k.time_range.end) for k in kernels)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


METHOD = ("torch.profiler on rank 0. collectives: NCCL kernels' device time (including the "
          "wait for the slower rank) on CUDA, gloo all_reduce/all_gather ops on CPU; step "
          "messages: the leader's sends (record_function tp:step_message); per_layer: kernel "
          "launch calls and collective ops starting inside a DecoderLayer call (median; graph "
          "replays have none)")
