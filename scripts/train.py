"""Train from the Hydra config in ``conf/`` (see README): ``python scripts/train.py [overrides]``."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LIT_SPEED_ROOT", str(ROOT))
if not os.path.exists("/dev/nvidia0"):  # no NVIDIA device: DeepSpeed's CPU accelerator, said explicitly
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import atexit  # noqa: E402

from lit_speed.run import process_end  # noqa: E402  (cheap: os)

# registered before any library's hook, so it runs after all of them: a multi-process run ends there with its
# status, without the interpreter's finalization, where gloo's threads can abort it (process_end.exit_after_exit_hooks)
atexit.register(process_end.exit_after_exit_hooks)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lit_speed.run.config_check import CommandLine  # noqa: E402
from lit_speed.run.config_error import ConfigError  # noqa: E402

#: Whether the pre-flight checked the config @hydra.main hands to main (a single run: its one composition, checked
#: before the job starts); a sweep's jobs are checked by the runner, each its own.
CHECKED = {"job": False}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lit_speed.run.config_error import RunStopped
    from lit_speed.run.runner import optimized_metric, train

    try:
        summary = train(cfg, checked=CHECKED["job"])
    except ConfigError as error:
        # a component refused the config before training: one line naming the setting and the fix.
        # HYDRA_FULL_ERROR=1 shows the traceback; in a sweep the job fails and the others go on.
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        print(f"Config error: {error}", file=sys.stderr)
        sys.exit(2)
    except RunStopped as error:  # stopped after it started (e.g. disk full): what happened, what was kept, how to go on
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        print(f"Run stopped: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    return optimized_metric(cfg, summary)


def refuse(error: ConfigError) -> None:
    """One line naming the setting and the fix, and exit status 2 (before anything is built)."""
    print(f"Config error: {error}", file=sys.stderr)
    sys.exit(2)


def check_main_composition(command: CommandLine):
    """The pre-flight on the config @hydra.main composes, before its job starts (lit_speed.compat.hydra): the checks
    of a single run's config, or the pre-flight's own reading of a composition that failed."""
    from hydra.types import RunMode

    from lit_speed.compat.hydra import on_main_composition
    from lit_speed.run.config_check import check_composed, explain_composition_error

    def composed(cfg: DictConfig) -> None:
        if cfg.hydra.get("mode") == RunMode.MULTIRUN:  # a sweep the config asks for: each job is checked by the runner
            return
        try:
            check_composed(cfg, command.firsts)
        except ConfigError as error:
            refuse(error)
        CHECKED["job"] = True

    def failed(error: BaseException) -> None:
        explained = explain_composition_error(command)
        if explained is not None:
            refuse(explained)

    return on_main_composition(composed, failed)


if __name__ == "__main__":
    import signal

    from lit_speed.checkpointing.signal_wakeup import watch_stop_signals
    from lit_speed.checkpointing.stop_signals import record_stop_signals
    from lit_speed.run.console import quiet_upstream_notices
    from lit_speed.run.launch_env import drop_local_rank_argument, move_busy_main_port, share_run_time

    quiet_upstream_notices()  # before the pre-flight, which may import transformers (and, through it, torchao)
    sys.argv[1:] = drop_local_rank_argument(sys.argv[1:])  # the deepspeed launcher's --local_rank=N (also in env)
    if (moved := move_busy_main_port()) is not None:  # an inherited MASTER_PORT another run holds: a free one
        print(moved, file=sys.stderr)
    # SIGTERM/SIGUSR1 during start-up are kept for the first batch, not fatal (peers wait); recorded when they arrive,
    # even while the main thread is in a long C call (a backward pass): the signal deadline counts from then
    watch_stop_signals(getattr(signal, name) for name in record_stop_signals())
    share_run_time()  # under torchrun: one run folder for all ranks (rank 0's time stamp)
    from lit_speed.run.config_check import preflight, read_command_line

    try:
        command = read_command_line(sys.argv[1:])  # what needs no composition: flags, overrides, folders
        if command.multirun:  # a sweep: its first values checked before any job starts (each job is checked again)
            preflight(sys.argv[1:])
    except ConfigError as error:
        refuse(error)
    try:
        if command.multirun:
            process_end.run_and_release(main)  # the exit status kept for exit_after_exit_hooks, the group released
        else:
            with check_main_composition(command):  # one composition, checked before the job starts
                process_end.run_and_release(main)
    finally:
        import gc

        gc.freeze()  # skip the interpreter's last full collection: 4-13 s of a loaded 2-core box's exit (torch + Lightning)
