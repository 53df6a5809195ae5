"""`specforge-csbp report`: regenerate docs/benchmarks.md (headline, plots of the newest records) and
docs/benchmarks_records.md (every record, speedups, planner predictions) from benchmark records."""

from __future__ import annotations

import argparse
import functools

from ..bench.records import BenchRecord
from ..bench.report import write_report
from ..errors import load_json
from ..preflight import check_writable_dir, check_writable_file

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="regenerate the benchmark report (markdown + PNG plots) from records")
    p.add_argument("--results", nargs="+", default=["benchmarks/results"],
                   help="record files or directories (*.json lists/objects, *.jsonl lines)")
    p.add_argument("--out", default="docs/benchmarks.md", help="headline page to write (newest measurements)")
    p.add_argument("--records-out", default=None,
                   help="every record's page (default: <stem of --out>_records.md beside it)")
    p.add_argument("--img-dir", default=None, help="where the PNGs go (default: <dir of --out>/img)")
    p.add_argument("--csv", default=None, help="also write every record as one CSV row here")
    p.add_argument("--title", default="Benchmarks")
    p.add_argument("--predict", nargs="*", default=[], metavar="WORKLOAD=CONFIG",
                   help="put the planner's prediction beside every ok record of WORKLOAD (model config.json)")
    p.add_argument("--profile", nargs="+", default=["h200-nominal"], metavar="[WORKLOAD=]PROFILE",
                   help="machine profile for --predict (JSON or built-in); WORKLOAD=PROFILE: that workload's own")
    p.add_argument("--scenarios", default=None, metavar="TOML",
                   help="named scenarios (benchmarks/scenarios.toml): the headline names each row's rerun")
    p.add_argument("--code-by-file", default=None, metavar="JSON",
                   help="{record file name: library digest} for records written before they carried `code`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    predictor, note, same_code = None, "", None
    if args.predict:
        # lazy: CLI start-up
        from ..planner.profile import load_profile
        from ..planner.validate import record_predictor

        models = {}
        for item in args.predict:
            workload, sep, config = item.partition("=")
            if not sep or not workload or not config:
                raise ValueError(f"predict must be WORKLOAD=CONFIG; got {item!r}")
            models[workload] = config
        default_name, own_names = _profile_names(args.profile)
        profile = load_profile(default_name)
        own = {w: load_profile(name) for w, name in own_names.items()}
        predictor = record_predictor(models, profile, own)
        used = [profile, *own.values()]
        if all(p.measured for p in used):
            same_code = functools.partial(_ran_calibrated_code, profile=profile, own=own)
        note = (f"Planner predictions use the profile `{default_name}` ({profile.summary()})"
                + "".join(f"; for `{w}` the profile `{own_names[w]}` ({p.summary()})" for w, p in sorted(own.items()))
                + " and the model configs " + ", ".join(f"`{w}`: `{c}`" for w, c in sorted(models.items())) + ".")

    for flag, path in (("--out", args.out), ("--records-out", args.records_out), ("--csv", args.csv)):
        if path:  # every output, before the records are read and the plots drawn
            check_writable_file(path, flag, must_exist_dir=False)
    if args.img_dir:
        check_writable_dir(args.img_dir, "--img-dir")
    code_by_file = load_json(args.code_by_file, "--code-by-file") if args.code_by_file else None
    rerun = None
    if args.scenarios:
        # lazy: CLI start-up
        from ..bench.scenarios import load_scenarios, rerun_command

        scenarios = load_scenarios(args.scenarios)

        def rerun(r: BenchRecord) -> str | None:
            anchors = (r.model_extra or {}).get("anchors")
            return rerun_command(scenarios, r.workload, r.world_size, r.context_len, anchors)

    records = write_report(args.results, args.out, img_dir=args.img_dir, csv_path=args.csv, title=args.title,
                           predictor=predictor, predictor_note=note, same_code=same_code, code_by_file=code_by_file,
                           records_path=args.records_out, rerun=rerun, allow_empty=False)
    print(f"report: {len(records)} records -> {args.out}")
    return 0


def _ran_calibrated_code(r: BenchRecord, *, profile, own: dict) -> bool:
    """Did `r` run the code its profile calibrated: for a profile that names its code (bench/provenance.py),
    the record's digest is the same (a record without one ran unknown code: no); for an older profile,
    the record was measured on or after the calibration date."""
    machine = own.get(r.workload, profile)
    if machine.code:
        return (r.model_extra or {}).get("code") == machine.code
    return r.date >= machine.date


def _profile_names(items: list[str]) -> tuple[str, dict[str, str]]:
    """`--profile` items -> (the default profile, workload -> its own profile); one default at most."""
    defaults = [item for item in items if "=" not in item]
    own = dict(item.split("=", 1) for item in items if "=" in item)
    if len(defaults) > 1:
        raise ValueError(f"profile: one default profile at most (others as WORKLOAD=PROFILE); got {defaults}")
    if any(not w or not name for w, name in own.items()):
        raise ValueError(f"profile: items are PROFILE or WORKLOAD=PROFILE; got {items}")
    return (defaults[0] if defaults else "h200-nominal"), own
