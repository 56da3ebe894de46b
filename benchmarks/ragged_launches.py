"""One launch or two: the ragged kernel's decode, mixed and prefill cases timed both ways on
one machine (GPU), with paged_attention_decode beside the decodes. Prints a table."""

from __future__ import annotations

from benchmarks.ragged_cases import MIXED, PREFILL, time_decode, time_ragged


def main():
  rows = [("decode 64 x 2K", "paged_attention_decode", time_decode([2048] * 64))]
  for one_launch in (True, False):
    name = "one launch" if one_launch else "two launches"
    rows.append(("decode 64 x 2K", name, time_ragged([2048] * 64, [1] * 64,
                                                    one_launch=one_launch)))
    rows.append(("mixed", name, time_ragged(*MIXED, one_launch=one_launch)))
  rows.append(("prefill", "two launches", time_ragged(*PREFILL, one_launch=False)))
  for case, impl, seconds in rows:
    print(f"{case:16s} {impl:24s} {seconds * 1e6:9.1f} us", flush=True)


if __name__ == "__main__":
  main()
