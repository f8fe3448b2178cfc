"""Tables from the suites' JSON files: benchmarks/results/README.md (a table per suite) and the performance table
between `<!-- results:start -->` and `<!-- results:end -->` in the repository's README.md.

    python benchmarks/tables.py [--results DIR] [--readme FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
DISK_START, DISK_END = "<!-- disk:start -->", "<!-- disk:end -->"  # the disk tier: planned, then measured
TRAIN = ("b1", "b3", "b8", "b1-documents", "b3-documents", "b8-documents", "moe", "moe-256k", "gemma2")
ORDER = (*TRAIN, "long", "tiny", "tiny-documents", "nvme", "largest", "plans", "dp2", "kernels", "attention", "io",
         "probe", "gpu-rates")
BENCH_NAMES = {"b1": "B1", "b3": "B3", "b8": "B8", "tiny": "tiny (CPU check)", "b1-documents": "B1 packed documents",
               "b3-documents": "B3 packed documents", "b8-documents": "B8 packed documents",
               "tiny-documents": "tiny packed documents (CPU check)", "moe": "MoE", "moe-256k": "MoE 256k tokens",
               "gemma2": "Gemma 2", "nvme": "NVMe tier against RAM", "dp2": "Data parallel, 1 and 2 ranks",
               "largest": "The largest model on this host", "plans": "Planned on paper",
               "long": "Long sequences", "gpu-rates": "GPU rates (planning fills in what a machine file lacks)"}
MODE_NAMES = {"1.0": "1.0", "1e6": "1e6 (never acts)", "none": "off"}
SHORT = {"slide": "Slide", "slide-nospec": "Slide, no speculation", "slide-spec": "Slide, speculating",
         "baseline": "Slide baseline", "plain": "plain", "liger": "plain + Liger"}


def num(value, fmt: str = ".2f", empty: str = "-") -> str:
    return empty if value is None else format(value, fmt)


def entry_line(e: dict) -> str:
    """One system's figures on a line (what run.py prints as each process ends)."""
    if e.get("status") != "ok":
        return f"{e.get('status')}: {e.get('reason', '')}"
    text = (f"{e['tokens_per_s']:,.0f} tok/s, {e['tflops']:.1f} TFLOP/s, step {e['step_s']:.3f} s, "
            f"GPU peak {e['gpu_peak_gib']:.1f} GiB, host RSS {e['host_rss_gib']:.1f} GiB")
    if e.get("exposed_share") is not None:
        text += f", exposed {e['exposed_share']:.1%}"
    if e.get("predicted_step_s") is not None:
        text += f", predicted {e['predicted_step_s']:.3f} s"
    return text


def header(doc: dict) -> str:
    v = doc.get("versions", {})
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    h = doc.get("host", {})
    if doc.get("suite") == "plans":  # (priced, not run: the machine that priced it does not matter)
        return f"commit `{doc.get('commit', 'unknown')[:10]}`, {doc.get('date', '')}; {versions}"
    return (f"{doc.get('device') or 'unknown device'}, host of {h.get('cores')} cores and {h.get('memory_gib')} GiB "
            f"RAM; commit `{doc.get('commit', 'unknown')[:10]}`, {doc.get('date', '')}; {versions}")


def earlier(e: dict, doc: dict) -> str:
    """` (commit, date)` for a figure merged from an earlier run of the suite than the file's, else ''; with its
    own steps where that run timed another number."""
    if not (e.get("commit") and e["commit"] != doc.get("commit")):
        return ""
    c = doc.get("config", {})
    own = e.get("steps") is not None and (e["steps"], e.get("warmup")) != (c.get("steps"), c.get("warmup"))
    steps = f", median of {e['steps']} after {e.get('warmup')} warm-up" if own else ""
    return f" (`{e['commit'][:10]}`, {e.get('date', '')[:10]}{steps})"


def train_table(doc: dict) -> list[str]:
    c = doc["config"]
    lines = [f"{c['model']} shape, {c['grad_accum']} micro-batches of {c['micro_batch_size']} x {c['seq_len']} = "
             f"{c['tokens_per_step']:,} tokens per step; median of {c['steps']} timed steps after {c['warmup']} "
             f"warm-up steps; "
             + (f"Slide capped at {c['cap_gib']:g} GiB of GPU memory" if c.get("cap_gib") else "Slide uncapped")
             + ", peers uncapped.", "",
             "| system | clip | tokens/s | vs baseline | TFLOP/s (6NT) | step s | GPU peak GiB | host RSS GiB | "
             "exposed | predicted s |", "|---|---|---|---|---|---|---|---|---|---|"]
    # Slide's tokens/s over the baseline's of the same mode (both measured in the same run)
    base = {e.get("mode"): e["tokens_per_s"] for e in doc["figures"]
            if e["system"] == "baseline" and e.get("status") == "ok"}
    for e in doc["figures"]:
        name = SHORT.get(e["system"], e["system"]) + (f" ({c['baseline']})" if e["system"] == "baseline"
                                                      and c.get("baseline") else "") + earlier(e, doc)
        mode = MODE_NAMES.get(e.get("mode"), e.get("mode"))
        if e.get("status") != "ok":
            lines.append(f"| {name} | {mode} | {e.get('status')}: {e.get('reason', '')[:160]} | | | | | | | |")
            continue
        share = e.get("exposed_share")
        ratio = e["tokens_per_s"] / base[e.get("mode")] if e["system"] == "slide" and e.get("mode") in base else None
        lines.append(f"| {name} | {mode} | {e['tokens_per_s']:,.0f} | {num(ratio, '.3f')} | {e['tflops']:.1f} | "
                     f"{e['step_s']:.3f} | "
                     f"{e['gpu_peak_gib']:.1f} | {e['host_rss_gib']:.1f} | {num(share, '.1%')} | "
                     f"{num(e.get('predicted_step_s'), '.3f')} |")
    for e in doc["figures"]:  # a mixture of experts: how evenly each timed step spread its tokens
        if e.get("expert_load"):
            who = f"{SHORT.get(e['system'], e['system'])}, clip {MODE_NAMES.get(e.get('mode'), e.get('mode'))}"
            lines += ["", f"{who}: least and most loaded expert per timed step, as multiples of an even share: "
                          + ", ".join(f"{low:.2f} / {high:.2f}" for low, high in e["expert_load"])]
    return lines


DISK_COLUMNS = ("| run | host budget GiB | tokens/s | step s | predicted s | bound by | host RSS GiB | "
                "GPU peak GiB | disk read GB/step | disk written GB/step | disk busy s (predicted) | store path |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def disk_row(name: str, e: dict) -> str:
    if e.get("status") != "ok":
        return f"| {name} | {num(e.get('host_budget_gib'), 'g', 'machine file')} | {e.get('status')}: " \
               f"{e.get('reason', '')[:160]} | | | | | | | | | |"
    return (f"| {name} | {num(e.get('host_budget_gib'), 'g', 'machine file')} | {e['tokens_per_s']:,.0f} | "
            f"{e['step_s']:.2f} | {num(e.get('predicted_step_s'))} | {e.get('predicted_bottleneck') or '-'} | "
            f"{e['host_rss_gib']:.1f} | {e['gpu_peak_gib']:.1f} | {num(e.get('disk_read_gb'), '.1f')} | "
            f"{num(e.get('disk_written_gb'), '.1f')} | {disk_busy(e)} | {e.get('disk_path') or '-'} |")


def disk_busy(e: dict) -> str:
    """The seconds of a timed step the tier's transfers took, beside the cost model's disk lane."""
    busy = (e.get("timeline_s") or {}).get("disk_busy_s")
    predicted = (e.get("predicted_lanes_s") or {}).get("disk")
    if busy is None and not predicted:
        return "-"
    return f"{num(busy, '.1f')} ({num(predicted, '.1f')})"


def nvme_table(doc: dict) -> list[str]:
    c = doc["config"]
    lines = [f"Slide, clip {c['mode']}, median of {c['steps']} timed steps after {c['warmup']} warm-up steps, "
             "unpacked rows; each run's shape as its suite's. `disk` puts every sliding block's fp32 master and "
             "AdamW moments on disk (engine.nvme.fraction=1); `disk-auto-host-64gib` plans for a host of 64 GiB "
             "with engine.nvme.fraction=auto.", "", *DISK_COLUMNS]
    def name(e: dict) -> str:
        return f"{e.get('bench')} {e.get('variant')}" + earlier(e, doc)

    measured = {e.get("commit") or doc.get("commit"): disk_note(e["disk_measured"]) for e in doc["figures"]
                if e.get("disk_measured")}
    if len(set(measured.values())) > 1:  # merged runs each measured the disk: say which figure is whose
        measured = {run: f"At `{run[:10]}`: {note[0].lower()}{note[1:]}" for run, note in measured.items()}
    lines[0] = " ".join([lines[0], *sorted(set(measured.values()))])
    return lines + [disk_row(name(e), e) for e in doc["figures"]]


def dp_table(doc: dict) -> list[str]:
    c = doc["config"]
    lines = [f"{c['bench']}'s shape per GPU ({c['model']}, {c['tokens_per_step_per_rank']:,} tokens per step per "
             f"GPU" + (f", capped at {c['cap_gib']:g} GiB each" if c.get("cap_gib") else "") + f"), clip "
             f"{c['mode']}, median of {c['steps']} timed steps after {c['warmup']} warm-up steps. Masters and "
             "moments: the engines' host tensors, summed over ranks; PSS splits shared pages between ranks.", "",
             "| ranks | tokens/s | vs 1 rank | step s | masters + moments GiB (sum) | vs 1 rank | PSS GiB per rank |",
             "|---|---|---|---|---|---|---|"]
    one = next((e for e in doc["figures"] if e.get("ranks") == 1 and e.get("status") == "ok"), None)
    for e in doc["figures"]:
        if e.get("status") != "ok":
            lines.append(f"| {e.get('ranks')} | {e.get('status')}: {e.get('reason', '')[:160]} | | | | | |")
            continue
        speed = e["tokens_per_s"] / one["tokens_per_s"] if one else None
        held = e.get("state_bytes_total")
        ratio = held / one["state_bytes_total"] if one and held and one.get("state_bytes_total") else None
        pss = ", ".join(num(r.get("pss_gib"), ".1f") for r in e.get("per_rank") or [])
        lines.append(f"| {e['ranks']} | {e['tokens_per_s']:,.0f} | {num(speed, '.2f')} | {e['step_s']:.3f} | "
                     f"{num(held and held / 2**30, '.2f')} | {num(ratio, '.3f')} | {pss or '-'} |")
    return lines


def largest_table(doc: dict) -> list[str]:
    c, f = doc["config"], doc["config"]["found"]
    lines = [f"The Llama shape with the most parameters that the plan puts at {c['step_limit_s']:g} s per step or "
             f"less (widths of {', '.join(c['widths'])}, any depth; fp32 or bf16 states; engine.nvme.fraction=auto; "
             f"{c['disk_free_gib']:g} GiB of disk free; GPU capped at {c['cap_gib']:g} GiB): {f['layers']} layers "
             f"at the width of {f['base']}, {f['params'] / 1e9:.2f}B parameters, {f['states_dtype']} states, "
             f"{f['blocks_on_disk']} of {f['sliding_blocks']} sliding blocks' states on disk (planned: host "
             f"{f['planned_host_gib']:.1f} GiB, disk {f['planned_disk_gib']:.1f} GiB). Clip 1.0, "
             f"{c['grad_accum']} micro-batches of {c['micro_batch_size']} x {c['seq_len']}; median of {c['steps']} "
             f"timed steps after {c['warmup']} warm-up; checkpoint.keep 0, no export. "
             + disk_note(c.get("disk_measured")), "", *DISK_COLUMNS]
    return lines + [disk_row(e.get("variant", "slide"), e) for e in doc["figures"]]


def disk_note(disk: dict | None) -> str:
    """Which disk rates the plan priced: the machine file's, or the disk measured as the tier uses it first."""
    if not disk:
        return "Planned with the machine file's disk rates."
    return (f"Planned with the disk measured first as the tier uses it ({disk['path']}, {disk['gib']:.0f} GiB in "
            f"{disk['file_mib']} MiB files): read {disk['read_gbps']:.2f}, write {disk['write_gbps']:.2f} GB/s.")


def plans_table(doc: dict) -> list[str]:
    c = doc["config"]
    lines = [f"`slide-train plan` (no GPU, no weights), {c['grad_accum']} micro-batches of {c['micro_batch_size']} x "
             f"{c['seq_len']} tokens per step, engine.nvme.fraction auto. A checkpoint writes every master and "
             "moment once and reads back the share on disk.", "",
             "| model | machine file | setting | fits | predicted step s | bound by | host GiB | disk GiB | "
             "blocks' states on disk | of them read for each load | gradients on disk | disk TB written per step | "
             "steps the drive's TBW lasts | checkpoint GiB | checkpoint s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["figures"]:
        fits = "yes" if e["fits"] else "no: " + e["problems"][-1].split(": masters")[0]  # (the last: what would)
        lines.append(f"| {e['model']} ({e['params'] / 1e9:.1f}B) | {pathlib.Path(e['machine']).name} | "
                     f"{e['setting']} | {fits} | {e['predicted_step_s']:.0f} | {e['bottleneck']} | "
                     f"{e['host_gib']:.0f} | {e['disk_gib']:.0f} | {e['blocks_on_disk']} of {e['sliding_blocks']} "
                     f"| {e.get('blocks_loading_from_disk', 0)} | {e.get('grads_on_disk', 0)} | "
                     f"{num(e.get('disk_written_gb') and e['disk_written_gb'] / 1e3, '.2f')} | "
                     f"{num(e.get('drive_tbw_steps'), ',.0f')} | {e['checkpoint_gib']:.0f} | "
                     f"{num(e['checkpoint_s'], '.0f')} |")
    return lines


def long_table(doc: dict) -> list[str]:
    """One row per run: its rows, clipping, speed and both FLOP counts, its plan and its peak memory."""
    lines = ["Tokens per step = rows x micro-batches; `tflops` counts 6·N·T, `tflops_attn` adds causal attention "
             "(6·L·d·S per token).", "",
             "| run | system | model | rows x micro-batches | clip | tok/s | TFLOP/s | TFLOP/s with attention | "
             "step s | predicted s | GPU peak GiB | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["figures"]:
        ok = e.get("status") == "ok"
        note = "" if ok else f"{e.get('status')}: {e.get('reason', '')}"[:120]
        if e.get("longest"):
            note = f"longest that ran: {e['longest']:,}"
        elif e.get("longest_fits"):
            note = f"the plan's longest: {e['longest_fits']:,}"
        rows = f"{e['seq_len']:,} x {e.get('grad_accum', 1)}" if e.get("seq_len") else "-"
        speed = {k: e.get(k) if ok else None for k in ("tokens_per_s", "tflops", "tflops_attn")}
        lines.append(f"| {e.get('variant', '')} | {e.get('label', e.get('system'))} | {e.get('model', '')} | {rows} | "
                     f"{e.get('mode', '')} | {num(speed['tokens_per_s'], ',.0f')} | "
                     f"{num(speed['tflops'], '.1f')} | {num(speed['tflops_attn'], '.1f')} | "
                     f"{num(e.get('step_s') if ok else None, '.2f')} | {num(e.get('predicted_step_s'), '.2f')} | "
                     f"{num(e.get('gpu_peak_gib') if ok else None, '.1f')} | {note} |")
    return lines


def kernels_table(doc: dict) -> list[str]:
    lines = ["Forward + backward, bf16: median ms (triton.testing.do_bench) and extra peak GiB.", "",
             "| op | shape | provider | ms | extra peak GiB |", "|---|---|---|---|---|"]
    for e in doc["figures"]:
        for op, r in e.get("results", {}).items():
            for provider, f in r["providers"].items():
                if provider.startswith("_"):
                    continue
                if "error" in f:
                    lines.append(f"| {op} | {r['shape']} | {provider} | error: {f['error'][:80]} | |")
                else:
                    lines.append(f"| {op} | {r['shape']} | {provider} | {f['ms']:.3f} | {f['peak_gib']:.3f} |")
    return lines


def attention_table(doc: dict) -> list[str]:
    lines = ["Forward + backward (and forward alone), bf16: median ms (triton.testing.do_bench), TFLOP/s in "
             "`causal_attention_flops`' count, and the largest of out, dq, dk, dv's errors against fp32 beside HF "
             "eager bf16's.", "",
             "| case | backend | ms | TFLOP/s | fwd TFLOP/s | error | eager bf16 error |",
             "|---|---|---|---|---|---|---|"]
    for e in doc["figures"]:
        for case, r in e.get("results", {}).items():
            eager = max(r["providers"].get("_eager_bf16_error", {}).values(), default=None)
            for provider, f in r["providers"].items():
                if provider.startswith("_"):
                    continue
                if "error" in f:
                    lines.append(f"| {case} | {provider} | error: {f['error'].splitlines()[0][:80]} | | | | |")
                else:
                    lines.append(f"| {case} | {provider} | {f['ms']:.3f} | {f['tflops']:.0f} | {f['fwd_tflops']:.0f} "
                                 f"| {max(f['rel_error'].values()):.2e} | {num(eager, '.2e')} |")
    return lines


def io_table(doc: dict) -> list[str]:
    lines = ["slide-io's disk store (NVMeStore), one tensor per write or read, median of rounds.", "",
             "| path | why | O_DIRECT | MiB | write GB/s | read GB/s | bytes equal |", "|---|---|---|---|---|---|---|"]
    for e in doc["figures"]:
        for s in e.get("sizes", []):
            lines.append(f"| {e['path']} | {e['reason']} | {e['o_direct']} | {s['mib']} | {s['write_gbps']:.2f} | "
                         f"{s['read_gbps']:.2f} | {s['bytes_equal']} |")
    tiers = [e for e in doc["figures"] if e.get("tier")]
    if tiers:
        t = tiers[0]["tier"]
        lines += ["", f"As the NVMe tier uses the disk: {t['gib']:.0f} GiB in {t['file_mib']} MiB files written in one "
                  "pass, read in another, then read and written back file by file (one direction at a time, as the "
                  "tier's transfers take turns), and a file read while the one before it is written. GB/s, both "
                  "directions' bytes together where both move; the cost model's rate is reads then writes.", "",
                  "| path | write | read | read then write, file by file | read while writing | reads then writes "
                  "(model) |", "|---|---|---|---|---|---|"]
        for e in tiers:
            t = e["tier"]
            lines.append(f"| {e['path']} | {t['write_gbps']:.2f} | {t['read_gbps']:.2f} | "
                         f"{t['read_then_write_gbps']:.2f} | {t['read_while_write_gbps']:.2f} | "
                         f"{t['reads_plus_writes_gbps']:.2f} |")
    return lines


def flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += flat(v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, v))
    return out


def probe_table(doc: dict) -> list[str]:
    lines = ["| key | value |", "|---|---|"]
    for e in doc["figures"]:
        lines += [f"| {k} | {v} |" for k, v in flat({k: v for k, v in e.items() if k not in ("system", "status")})]
    return lines


def suite_table(doc: dict) -> str:
    suite = doc["suite"]
    body = {"kernels": kernels_table, "attention": attention_table, "io": io_table, "probe": probe_table,
            "gpu-rates": probe_table,
            "nvme": nvme_table, "largest": largest_table, "plans": plans_table, "dp2": dp_table,
            "long": long_table}.get(suite, train_table)(doc)
    return "\n".join([f"## {BENCH_NAMES.get(suite, suite)}", "", header(doc), "", *body, ""])


def cell(e: dict | None, doc: dict) -> str:
    if e is None:
        return "-"
    if e.get("status") != "ok":
        return e.get("status", "-") + earlier(e, doc)
    return f"{e['tokens_per_s']:,.0f} tok/s, {e['gpu_peak_gib']:.1f} GiB" + earlier(e, doc)


def main_table(docs: dict[str, dict]) -> str | None:
    """The README's table: per bench and clip mode, the peers and Slide (tokens/s and peak GPU memory)."""
    rows = ["| bench | clip | plain GPU-resident | plain + Liger-Kernel | Slide (GPU cap) |", "|---|---|---|---|---|"]
    notes = []
    for suite in TRAIN:
        doc = docs.get(suite)
        if doc is None:
            continue
        c = doc["config"]
        by = {(e["system"], e.get("mode")): e for e in doc["figures"]}
        for mode in ("1.0", "1e6", "none"):
            if not any((s, mode) in by for s in ("slide", "plain", "liger")):
                continue
            slide = cell(by.get(("slide", mode)), doc)
            if slide != "-" and c.get("cap_gib"):
                slide += f" ({c['cap_gib']:g} GiB cap)"
            rows.append(f"| {BENCH_NAMES[suite]} {c['model']}, {c['grad_accum']} x {c['micro_batch_size']} x "
                        f"{c['seq_len']} | {MODE_NAMES[mode]} | {cell(by.get(('plain', mode)), doc)} | "
                        f"{cell(by.get(('liger', mode)), doc)} | {slide} |")
        notes.append(f"{BENCH_NAMES[suite]}: {header(doc)}.")
    if len(rows) == 2:
        return None
    return "\n".join(rows + ["", *notes, "",
                             "Generated by `python benchmarks/tables.py` from benchmarks/results/*.json; how the "
                             "figures are counted: benchmarks/README.md."])


def load(results: pathlib.Path) -> dict[str, dict]:
    docs = {}
    for path in sorted(p for p in results.glob("*.json") if not p.name.endswith(".partial.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "suite" in doc and "figures" in doc:
            docs[doc["suite"]] = doc
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    args = p.parse_args()
    docs = load(args.results)
    if not docs:
        sys.exit(f"no suite results in {args.results}: run benchmarks/run.py first")
    order = [s for s in ORDER if s in docs] + sorted(set(docs) - set(ORDER))
    text = "\n".join(["# Benchmark results", "",
                      "Generated by `python benchmarks/tables.py` from the JSON files here (the latest run of each "
                      "suite; git keeps earlier ones). How they are measured: [../README.md](../README.md).", "",
                      *[suite_table(docs[s]) for s in order]])
    (args.results / "README.md").write_text(text)
    print(f"wrote {args.results / 'README.md'}")
    readme = args.readme.read_text() if args.readme.is_file() else ""
    disk = [suite_table(docs[s]).replace("## ", "### ", 1) for s in ("plans", "nvme", "largest") if s in docs]
    for start, end, table in ((START, END, main_table(docs)), (DISK_START, DISK_END, "\n".join(disk) or None)):
        if table is None:
            print(f"no results for the {start} block: left as it is")
        elif start in readme and end in readme and readme.index(start) < readme.index(end):
            head, rest = readme.split(start, 1)
            readme = f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}"
            print(f"updated the {start} block in {args.readme}")
        else:
            print(f"{args.readme} has no '{start}' / '{end}' lines: that table is in {args.results / 'README.md'}")
    if args.readme.is_file():
        args.readme.write_text(readme)


if __name__ == "__main__":
    main()
