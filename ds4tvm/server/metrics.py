"""`GET /metrics` of `ds4 serve`: Prometheus' text format (version 0.0.4), read from the service and
its engine when scraped."""

from __future__ import annotations

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _line(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *(f"{name}{labels} {value:g}" for labels, value in samples)]


def _histogram(name: str, help_: str, calls) -> list[str]:
    """A histogram of call sizes from a Counter of size -> calls."""
    buckets = [(f'_bucket{{le="{b}"}}', sum(n for size, n in calls.items() if size <= b)) for b in BATCH_BUCKETS]
    total = sum(calls.values())
    return [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *(f"{name}{labels} {v}" for labels, v in buckets),
            f'{name}_bucket{{le="+Inf"}} {total}', f"{name}_sum {sum(size * n for size, n in calls.items())}",
            f"{name}_count {total}"]


def metrics_text(service) -> str:
    c = service.counters()
    out = []
    out += _line("ds4_requests_running", "gauge", "requests generating now", [("", c["running"])])
    out += _line("ds4_requests_queued", "gauge", "requests waiting for a free worker", [("", service.jobs.qsize())])
    out += _line("ds4_parallel", "gauge", "requests generated at once at most", [("", service.parallel)])
    out += _line("ds4_requests_total", "counter", "requests answered, by outcome",
                 [(f'{{outcome="{k}"}}', v) for k, v in sorted(c["outcomes"].items())])
    out += _line("ds4_prompt_tokens_total", "counter", "prompt tokens of the requests begun", [("", c["prompt"])])
    out += _line("ds4_prompt_tokens_cached_total", "counter",
                 "prompt tokens continued from a kept sequence or checkpoint instead of prefilled (cache hits)",
                 [("", c["cached"])])
    out += _line("ds4_prompt_tokens_beside_decodes_total", "counter",
                 "prompt tokens prefilled in the same call as other requests' decode steps",
                 [("", service.engine.prefilled_beside_decodes)])
    out += _line("ds4_generated_tokens_total", "counter", "tokens generated", [("", c["generated"])])
    out += _line("ds4_generated_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
                 [("", c["tok_s"])])
    out += _histogram("ds4_decode_batch_size", "sequences per decode call", service.engine.decode_calls)
    out += _histogram("ds4_verify_batch_size",
                      "sequences per verify call (speculative decoding; a decode step in a verify call counts here)",
                      service.engine.verify_calls)
    out += _histogram("ds4_draft_step_batch_size",
                      "sequences per call of a drafter's step (where the artifact has its batched copies)",
                      service.engine.step_calls)
    return "\n".join(out) + "\n"
