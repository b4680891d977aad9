"""`deepinfer up`: the whole stack on this machine until Ctrl-C or SIGTERM.

Terminal: the supervisor's own lines (progress, restarts) and every child's log lines, prefixed with the
child's name, go to stderr; the banner with the base URL goes to stdout. Each child's full log is also kept
in <data_dir>/up/logs/<name>.log (DEEPINFER_DATA_DIR; rewritten on every start).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from deepinfer.config import DEFAULT_MODEL
from deepinfer.up.devices import DEVICE_CHOICES

if TYPE_CHECKING:
    from deepinfer.up.logs import LogEcho
    from deepinfer.up.stack import Stack

log = logging.getLogger("deepinfer.up")

EXIT_OK = 0
EXIT_FAILED = 1


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived: stop the stack."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `deepinfer up` (each maps to settings the children get by environment)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve (default: {DEFAULT_MODEL})")
    add_stack_arguments(parser)


def add_stack_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default_port: int = 8000
) -> None:
    """The flags that shape the stack, all but --model (`deepinfer bench run --up` has a --model of its own);
    `default_port=0`: any free port."""
    parser.add_argument(
        "--device", choices=DEVICE_CHOICES, default="auto", help="workers' device (default: auto)"
    )
    parser.add_argument(
        "--port", type=_port, default=default_port,
        help=f"gateway API port (default: {default_port or 'any free port'})",
    )
    parser.add_argument(
        "--prefill", type=_count, default=None, metavar="N",
        help="prefill workers (default: 1; 0 on a single GPU, where the decode worker computes prompts itself)",
    )
    parser.add_argument("--decode", type=_count, default=1, metavar="M", help="decode workers (default: 1)")
    parser.add_argument(
        "--schedulers", type=_count_positive, default=None, metavar="K",
        help="scheduler replicas (default: 2 from 4 usable cores, else 1; gateways route themselves while none "
        "answers)",
    )
    parser.add_argument(
        "--kvcache", type=_count, default=1, metavar="S",
        help="kvcache store shards, data under DEEPINFER_DATA_DIR/kvcache (default: 1; 0: none)",
    )
    parser.add_argument(
        "--gateways", type=_count_positive, default=None, metavar="G",
        help="gateway processes sharing the API port (default: one per 4 cores, 1 to 4)",
    )
    parser.add_argument(
        "--speculative-config", type=_speculative_config, default=None, metavar="JSON",
        help='the decode workers\' speculative decoding, vLLM\'s dict as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (docs/speculative.md; default: off)',
    )
    parser.add_argument(
        "--enable-hybrid-kv-cache", action="store_true",
        help="KV by layer type on the decode workers for sliding-window models such as Gemma 3 (docs/models.md); "
        "no prefill worker unless --prefill says (a prefill worker's KV would be recomputed there)",
    )


def run(args: argparse.Namespace) -> int:
    """Start the stack, wait until it is ready, print the URL, serve until a signal; 0 on a clean stop."""
    from deepinfer.up.stack import StackError

    try:
        with local_stack(args, echo_logs=True) as stack:
            if not stack.gateway_waits_for_workers:
                log.info("no local prefill or decode worker: the gateway's /ready stays 503 until workers join")
            _print_banner(stack)
            threading.Event().wait()  # until a signal raises StopRequested
    except PortInUse as exc:
        print(f"deepinfer up: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except StackError:
        return EXIT_FAILED  # local_stack logged why
    except StopRequested:
        pass  # local_stack said so and stopped the stack
    return EXIT_OK


class PortInUse(Exception):
    """The gateway's port is taken: nothing was started."""


@contextmanager
def local_stack(args: argparse.Namespace, echo_logs: bool) -> Iterator[Stack]:
    """The stack of `deepinfer up`'s flags (`add_arguments`), started and ready for the block, stopped after it.

    The supervisor's lines (progress, restarts) go to stderr, and with `echo_logs` every child's log lines too
    (each child's full log stays in <data_dir>/up/logs). From start to stop the first SIGINT/SIGTERM raises
    StopRequested in the main thread, a second one kills every child. Raises PortInUse before starting anything,
    StackError when the stack does not become ready (logged, and the stack stopped again by then)."""
    from deepinfer.config import CommonSettings, load_settings
    from deepinfer.up.logs import LogEcho
    from deepinfer.up.stack import HOST, Stack, StackError

    common = load_settings(CommonSettings)  # exits 2 with one line on a bad DEEPINFER_* value
    if not _port_free(HOST, args.port):
        raise PortInUse(f"port {args.port} on {HOST} is in use; pass --port")
    stack = Stack(
        model=args.model,
        device=args.device,
        port=args.port,
        num_prefill=num_prefill(args),
        num_decode=args.decode,
        num_schedulers=args.schedulers,
        num_gateways=args.gateways,
        num_kvcache=args.kvcache,
        log_dir=common.data_dir / "up" / "logs",
        env_overrides=_worker_env(args),
    )
    handler = _setup_logging(width=max(len(name) for name in _child_names(stack)))
    echo = LogEcho(sys.stderr) if echo_logs else None
    signals = _SignalHandler(stack)
    try:
        signals.install()
        _start(stack, echo)
        yield stack
    except StopRequested as exc:
        log.info("%s received: stopping (send it again to kill at once)", exc)
        raise
    except StackError as exc:
        log.error("%s", exc)
        raise
    finally:
        signals.num_signals = max(1, signals.num_signals)  # from here on a signal kills, never interrupts
        stack.stop()
        if echo is not None:
            echo.stop()
        signals.uninstall()
        log.info("stopped")
        logging.getLogger("deepinfer").removeHandler(handler)


def _start(stack: Stack, echo: LogEcho | None) -> None:
    stack.start()
    if echo is not None:
        for name, info in stack.services.items():
            echo.add(name, info.log_path)
        echo.start()
    log.info("waiting for %s (logs: %s)", ", ".join(stack.services), stack.log_dir)
    stack.wait_ready(on_ready=_report_ready, on_waiting=_report_waiting)


def _report_ready(name: str, seconds: float) -> None:
    log.info("%s ready in %.1f s", name, seconds)


def _report_waiting(pending: dict[str, str], seconds: float) -> None:
    for name, reason in pending.items():
        log.info("still waiting for %s after %.0f s: %s", name, seconds, reason)


def _print_banner(stack: Stack) -> None:
    print(
        f"\nDeepInfer is up: model {stack.model_name}\n"
        f"  OpenAI base URL: {stack.base_url}\n"
        f"  try:  curl {stack.base_url}/models\n"
        f"  logs: {stack.log_dir}\n"
        f"  stop: Ctrl-C\n",
        flush=True,
    )


class _SignalHandler:
    """The first SIGINT/SIGTERM raises StopRequested in the main thread; a second one SIGKILLs every child."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.num_signals = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Take over SIGINT and SIGTERM (main thread only)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.num_signals += 1
        if self.num_signals == 1:
            raise StopRequested(signal.Signals(signum).name)
        log.warning("%s received again: killing every child now", signal.Signals(signum).name)
        self.stack.supervisor.kill_all()


def _setup_logging(width: int) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{'up':<{width}} | %(message)s"))
    logger = logging.getLogger("deepinfer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _child_names(stack: Stack) -> list[str]:
    workers = [f"prefill-{i}" for i in range(stack.num_prefill)] + [
        f"decode-{i}" for i in range(stack.num_decode)
    ]
    gateways = [f"gateway-{g}" for g in range(stack.num_gateways)]
    stores = [f"kvcache-{k}" for k in range(stack.num_kvcache)]
    return ["nats", *gateways, *[f"scheduler-{k}" for k in range(stack.num_schedulers)], *stores, *workers]


def _port_free(host: str, port: int) -> bool:
    """Whether the gateway can bind the port: bound as it binds (SO_REUSEADDR), so TIME-WAIT sockets left by an
    earlier run do not count as in use, while a listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {value}")
    return value


def _speculative_config(text: str) -> str:
    """The flag's JSON, checked as the engine will check it (a bad one stops `up` before anything starts); a
    draft_model's `model` that names an existing path made absolute, as --model is (children may run elsewhere)."""
    from deepinfer.engine.spec_config import SpeculativeConfig
    from deepinfer.up.stack import absolute_if_path

    try:
        value = json.loads(text)
        config = SpeculativeConfig.of(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if config is not None and config.method == "draft_model" and absolute_if_path(config.model) != config.model:
        return json.dumps({**value, "model": absolute_if_path(config.model)})
    return text


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    """Settings of the flags that only some children read, by environment."""
    env = {}
    if args.speculative_config is not None:
        env["DEEPINFER_DECODE_SPECULATIVE_CONFIG"] = args.speculative_config
    if args.enable_hybrid_kv_cache:
        env["DEEPINFER_DECODE_ENABLE_HYBRID_KV_CACHE"] = "true"
    return env


def num_prefill(args: argparse.Namespace) -> int | None:
    """--prefill; with --enable-hybrid-kv-cache and no --prefill, none (None: the stack's default)."""
    if args.prefill is None and args.enable_hybrid_kv_cache:
        return 0
    return args.prefill


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _count_positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
