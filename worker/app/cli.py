"""``worker`` command line. Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or usage, 130
interrupted."""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
from collections.abc import Sequence
from typing import get_args

from schemas import ErrorStage
from worker import __version__
from worker.app.command_support import CommandError, check_devices, unreachable_broker_is_an_error
from worker.config.settings import Config, ConfigError, load, name_overrides
from worker.models.registry import BUILTINS

log = logging.getLogger("worker")

EPILOG = """Configuration: one YAML file (see README "Configuration"); any key can be overridden with
WORKER__SECTION__KEY environment variables, e.g. WORKER__KAFKA__BOOTSTRAP_SERVERS=broker:9092.

Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or usage (the message names the bad key),
130 interrupted (Ctrl-C)."""

def _config(path: str | None, files_elsewhere: bool = False) -> Config:
    from worker.kafka.clients import config_problem

    return load(path, client_check=config_problem, files_elsewhere=files_elsewhere)


def cmd_check_config(args: argparse.Namespace) -> int:
    from worker.app.check_config import check

    report = check(args.config)
    for note in report.notes:
        print(f"note: {name_overrides(note)}", file=sys.stderr)
    if report.problems:
        for problem in report.problems:
            print(f"config error: {name_overrides(problem)}", file=sys.stderr)
        return 2
    cfg = report.cfg
    assert cfg is not None
    # The config may be checked outside the pod its CA or key files are mounted in: a file that is not here is
    # a note, as a device that is not here is.
    from worker.kafka.clients import absent_files

    for key, file in absent_files(cfg):
        print(f"note: {name_overrides(f'{key}: {file} is not on this machine')} (not checked; `worker run` "
              "here would exit 2)", file=sys.stderr)
    try:
        check_devices(cfg)
    except ConfigError as e:
        # Not an error here: the config may well be checked on a CI machine without the run's GPU. `worker
        # run` on this machine would refuse it (exit 2).
        print(f"note: {name_overrides(str(e))} (`worker run` here would exit 2)", file=sys.stderr)
    if args.print:
        import yaml

        from worker.config.settings import redact_config, to_dict

        # Secrets are resolved by now (${env:...}, ${file:...}): the output may land in a CI log or a ticket.
        print(yaml.safe_dump(redact_config(to_dict(cfg)), sort_keys=False))
    else:
        print(f"{args.config}: OK ({len(cfg.batching.lanes)} lane(s), topics {cfg.input_topics()}, "
              f"model {cfg.model.name!r} ({report.model_kind}), delivery {cfg.delivery.mode})")
    return 0


def _setup_logging(cfg: Config, level: str | None = None) -> None:
    try:
        from worker.observability.logs import setup_logging
    except ImportError:  # pragma: no cover - logs module is part of the package
        logging.basicConfig(level=level or cfg.logging.level)
        return
    setup_logging(level or cfg.logging.level, cfg.logging.format)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args.config)
    if args.metrics_port is not None and not cfg.metrics.enabled:
        # Asking for a port asks for the endpoint: silently serving nothing would be the surprise.
        import msgspec

        cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, enabled=True))
    _setup_logging(cfg)
    processes = args.processes or cfg.model.processes
    if processes > 1:
        from worker.app.supervisor import supervise

        return supervise(cfg, args.config, processes, metrics_port=args.metrics_port)
    from worker.app.service import run_service

    return run_service(cfg, metrics_port=args.metrics_port)


def cmd_predict(args: argparse.Namespace) -> int:
    import msgspec

    from worker.app.predict import InputError, predict, read_requests

    cfg = load(args.config)
    device = args.device or (cfg.model.devices[0] if cfg.model.devices else cfg.model.device)
    # Requests and results are JSON lines here, whatever the topics carry; one device is plenty.
    cfg = msgspec.structs.replace(
        cfg, delivery=msgspec.structs.replace(cfg.delivery, format="json"),
        model=msgspec.structs.replace(cfg.model, device=device, devices=[]))
    try:
        requests = read_requests(args.input, args.file)
    except InputError as e:
        print(f"input error: {e}", file=sys.stderr)
        return 2
    check_devices(cfg)
    _setup_logging(cfg, "WARNING" if not args.verbose else None)
    return predict(cfg, requests, device=device, topic=args.topic)


def cmd_backfill(args: argparse.Namespace) -> int:
    cfg = _config(args.config)
    _setup_logging(cfg, "WARNING" if not args.verbose else None)
    from worker.app.backfill import backfill

    if args.from_timestamp is not None and args.from_timestamp < 0:
        print("usage error: --from-timestamp must be a Unix time in milliseconds (>= 0)", file=sys.stderr)
        return 2
    # 30 s: the metadata timeout of backfill.snapshot, its first call to the broker.
    with unreachable_broker_is_an_error(cfg.kafka.bootstrap_servers, "$.kafka.bootstrap_servers", 30):
        return backfill(cfg, from_beginning=args.from_beginning, from_timestamp=args.from_timestamp,
                        group=args.group)


def cmd_demo(args: argparse.Namespace) -> int:
    from worker.app.demo import demo

    for name in ("records", "partitions", "rate"):
        if getattr(args, name) <= 0:
            print(f"usage error: --{name} must be > 0", file=sys.stderr)
            return 2
    if args.warm_up_s is not None and args.warm_up_s < 0:
        print("usage error: --warm-up-s must be >= 0", file=sys.stderr)
        return 2
    return demo(records=args.records, model=args.model, bootstrap=args.bootstrap, partitions=args.partitions,
                rate=args.rate, warm_up_s=args.warm_up_s)


def cmd_load(args: argparse.Namespace) -> int:
    from worker.app.load import load_main

    return load_main(args)


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 0:
        print("usage error: --limit must be >= 0", file=sys.stderr)
        return 2
    cfg = _config(args.config)
    _setup_logging(cfg)
    from worker.app.dlq import replay

    return replay(cfg, limit=args.limit, stage=args.filter_stage, dry_run=args.dry_run)


def cmd_profile(args: argparse.Namespace) -> int:
    from worker.app.profile import run

    return run(args)


def _finite(text: str) -> float:
    """A float flag: nan passes every range check (and meant "unthrottled" to --rate), inf overflowed
    later."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {port}")
    return port


def _processes(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes from 1 to 64, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="worker", description=(
        "Kafka inference worker: consume requests, micro-batch them by count or time in priority lanes, "
        "run a PyTorch model, produce results, commit offsets only after delivery."), epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the package version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser(
        "run",
        help="run the worker until SIGTERM/SIGINT",
        description=(
            "Consume the input topics, batch, infer, produce results and commit. SIGTERM/SIGINT stop it "
            "gracefully: stop fetching, finish in-flight work within "
            "delivery.shutdown_timeout_s, commit, exit 0."
        ),
    )
    r.add_argument("--config", "-c", required=True, help="worker YAML config file")
    r.add_argument("--metrics-port", type=_port, default=None, help=(
        "serve /metrics, /healthz and /readyz on this port instead of metrics.port (0 = any free port); "
        "turns the endpoint on even where metrics.enabled is false"))
    r.add_argument("--processes", type=_processes, default=None, metavar="N", help=(
        "run N worker processes sharing the device(s), each a member of the consumer group, under a "
        "supervisor that restarts a dead one (default: model.processes, 1); process i "
        "serves metrics on port + i"))
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("check-config", help="validate a config file and exit (0 valid, 2 invalid)",
                       description=(
        "Loads the file with WORKER__* environment overrides and secret references applied, validates every "
        "key (an unknown one with the closest known name), checks that model.name resolves (a built-in and "
        "its options, an existing model file, a factory that imports and takes the options given, a handler "
        "class with its five stages; no weights are loaded) and that librdkafka takes the kafka.consumer and "
        "kafka.producer properties, and exits 0, or 2 with every problem found, one line each, sorted by the "
        "key's path. A secret reference (${env:X}, ${file:...}) or a client file (ssl.ca.location...) that "
        "is not on this machine is a note, not an error: it may exist only where the worker runs. "
        "Connects to nothing."))
    c.add_argument("--config", "-c", required=True, help="worker YAML config file")
    c.add_argument("--print", action="store_true", help=(
        "print the effective config (defaults, env overrides and secret references applied; values of "
        "secret-looking keys and URL passwords shown as ***)"))
    c.set_defaults(func=cmd_check_config)

    pd = sub.add_parser("predict", help="run requests through the configured model, no Kafka", description=(
        "Runs JSON requests through the model the config names, as `worker run` would (the same validation, "
        "lane routing, model stages and result envelope), and prints one result per line on stdout; a line "
        "on stderr says why each failed request failed. Connects to nothing. Exits 0 when every result is "
        "ok, 1 when a request failed (an error or expired result), 2 for a bad config or input (the message "
        "names the key, or the line that is not JSON)."))
    pd.add_argument("--config", "-c", required=True, help="worker YAML config file")
    src = pd.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", "-i", metavar="JSON",
                     help='one request, e.g. \'{"id": "r1", "inputs": [1, 2]}\'')
    src.add_argument("--file", "-f", metavar="PATH", help="JSON lines, one request per line ('-': stdin)")
    pd.add_argument("--topic", default=None, help=(
        "the input topic the requests are taken to come from, which picks their lane as in `worker run` "
        "(default: the first input topic of the default lane)"))
    pd.add_argument("--device", default=None, help=(
        "run the model on this device (cpu, cuda, cuda:N, mps; default: model.device, or the first of "
        "model.devices)"))
    pd.add_argument("--verbose", action="store_true", help="log at the configured level instead of WARNING")
    pd.set_defaults(func=cmd_predict)

    d = sub.add_parser("demo", help="one-command demo: local broker, sample requests, worker, summary",
                       description=(
        "Starts a local Apache Kafka broker (unless KAFKA_BOOTSTRAP_SERVERS or --bootstrap is given), "
        "creates topics, produces sample requests, runs the worker with a built-in model, "
        "prints a summary, stops."))
    d.add_argument("--records", type=int, default=5000, help="sample requests to produce (default 5000)")
    d.add_argument("--partitions", type=int, default=4, help="partitions of the demo's topics (default 4)")
    d.add_argument("--rate", type=_finite, default=2000.0,
                   help="records/s the requests are produced at (default 2000)")
    d.add_argument("--model", default="tiny", choices=list(BUILTINS), help="built-in model (default tiny)")
    d.add_argument("--bootstrap", default=None, help=(
        "use this broker instead of starting one (default: $KAFKA_BOOTSTRAP_SERVERS where set)"))
    d.add_argument("--warm-up-s", type=_finite, default=None, help=(
        "seconds of throwaway traffic through the broker before the measured run, while the model loads "
        "(default 5 with the demo's own freshly started broker, whose JVM is still cold; 0 with --bootstrap "
        "or KAFKA_BOOTSTRAP_SERVERS, whose broker is taken to be warm)"))
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("backfill", help="process the input topics up to their current end, then exit",
                       description="Snapshots the end offsets of the input topics, processes until every "
                       "partition reaches them, commits and exits 0. Killed, it resumes from "
                       "the committed offsets.")
    b.add_argument("--config", "-c", required=True, help="worker YAML config file")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--from-beginning", action="store_true", help=(
        "start the partitions the group has no commit for at the earliest offset, whatever auto.offset.reset "
        "says; committed ones go on from the commit (a new --group starts over)"))
    g.add_argument("--from-timestamp", type=int, default=None, metavar="MS", help=(
        "start at the first record at or after this Unix time in milliseconds, except where the group "
        "committed past it: there it goes on from the commit"))
    b.add_argument("--group", default=None, help="consumer group (default: kafka.group_id + '-backfill')")
    b.add_argument("--verbose", action="store_true", help="log at the configured level instead of WARNING")
    b.set_defaults(func=cmd_backfill)

    ld = sub.add_parser("load", help="produce synthetic requests at a given rate", description=(
        "Produces COUNT valid requests for a built-in model's input shape (keys and ids PREFIX-0, PREFIX-1, "
        "...) at RATE records/s, waits until each is acknowledged, and exits 0; exits 1 if the broker does "
        "not answer or a record is not delivered."))
    ld.add_argument("--bootstrap", default=None,
                    help="broker (default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092)")
    ld.add_argument("--topic", required=True, help="topic to produce to")
    ld.add_argument("--rate", type=_finite, default=1000.0,
                    help="records per second (default 1000; 0 = as fast as possible)")
    ld.add_argument("--count", type=int, default=10000, help="records to produce (default 10000)")
    ld.add_argument("--lanes", default=None, help="priority mix, e.g. high=0.1,low=0.9 "
                                                  "(sets the request field)")
    ld.add_argument("--model-input", default="tiny", choices=list(BUILTINS),
                    help="built-in model whose input shape the requests get (default tiny)")
    ld.add_argument("--id-prefix", default="load", help="request ids and keys are PREFIX-N (default load)")
    ld.add_argument("--deadline-ms", type=int, default=None, metavar="MS", help=(
        "give each request a deadline MS milliseconds after it is sent (its deadline_ms field, an "
        "absolute Unix time in ms); the worker expires what it cannot answer by then (default: no deadline)"))
    ld.set_defaults(func=cmd_load)

    dq = sub.add_parser("dlq", help="dead-letter topic tools")
    dsub = dq.add_subparsers(dest="dlq_command", required=True, metavar="SUBCOMMAND")
    rp = dsub.add_parser("replay", help="re-submit dead letters to their source topic",
                         description="Reads the DLQ topic (its own consumer group, so each dead letter is "
                         "replayed once), strips the x-error*/x-source* headers and produces the original "
                         "key, value and headers to the source topic. Stops at the end of the DLQ snapshot "
                         "taken at start. Dead letters without their original bytes (dropped as too big, "
                         "empty, tombstones) are skipped and listed.")
    rp.add_argument("--config", "-c", required=True,
                    help="worker YAML config file (its kafka section is used)")
    rp.add_argument("--limit", type=int, default=None, help="replay at most this many dead letters")
    # choices: a stage no dead letter can carry ("", a typo) would skip and commit past every one of them.
    rp.add_argument("--filter-stage", default=None, choices=get_args(ErrorStage), metavar="STAGE", help=(
        "only dead letters of this x-error-stage: " + ", ".join(get_args(ErrorStage))
        + " (progress kept in the group <group_id>-dlq-replay-STAGE)"))
    rp.add_argument("--dry-run", action="store_true", help="list what would be replayed; produce nothing")
    rp.set_defaults(func=cmd_dlq_replay)

    pr = sub.add_parser("profile", help="throughput/latency/memory per batch size for a model", description=(
        "Runs the model alone (no Kafka) on each batch size and prints p50/p99 batch latency, items/s and "
        "peak memory, then recommends a max_batch_size: the highest throughput, or the highest within "
        "--latency-budget-ms. A batch size that runs out of memory is reported, and "
        "larger ones are not tried."))
    try:
        from worker.app.profile import add_arguments
        add_arguments(pr)
    except ImportError:  # pragma: no cover
        pass
    pr.set_defaults(func=cmd_profile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    finally:
        # The runner freezes the objects alive after the model load (gc.freeze), and what is frozen is never
        # collected, not even at exit: a nanobind extension among them (triton's, which torch._dynamo imports
        # when transformers loads a model) would then print ~30 "nanobind: leaked ..." lines as the process
        # ends. Unfrozen, they are collected at exit like everything else.
        gc.unfreeze()


def _main(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        # The checks after loading (model, devices) name the key; README promises the variable that set it
        # too.
        for problem in e.problems:
            print(f"config error: {name_overrides(problem)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except CommandError as e:  # a message that says it all: no traceback
        log.error("fatal error: %s", e)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # logged with its traceback, then one plain line for the terminal
        # The cause in the message too: a JSON log line's msg is what log search and alerts show.
        log.error("fatal error: %s: %s", type(e).__name__, e, exc_info=True)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
