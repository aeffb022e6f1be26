"""``paella serve``: the daemon, one package of parts.

| module | what |
|---|---|
| ``command.py`` | the command line (``paella serve``, ``main``) |
| ``config.py`` | ``DaemonConfig``: the TOML file, defaults, checks |
| ``server.py`` | ``Daemon``: the loop, idle modes, signals, lifecycle; the device it opens |
| ``executors.py`` | the execution paths: host models, the Dispatcher, the router |
| ``bundles.py`` | bundles on the dispatcher, the simulator's functional outputs and their cache |
| ``builtin_models.py`` | ``echo`` and ``noop`` |
| ``repository.py`` | reading bundles off the loop (start-up, SIGHUP reloads) |
| ``unit.py`` | ``paella unit``: the systemd unit, ExecStart naming this installation's command |
| ``system.py`` | process set-up: gc freeze, sd_notify, core pinning, priority |
"""
from .bundles import FunctionalCache, bundle_adaptor, functional_adaptor, model_info_from_bundle
from .command import main, register
from .config import ConfigError, DaemonConfig, config_from_args, load_config
from .server import EXIT_DEVICE_LOST, Daemon, open_device_for
from .system import freeze_heap, sd_notify

__all__ = ["ConfigError", "Daemon", "DaemonConfig", "EXIT_DEVICE_LOST", "FunctionalCache",
           "bundle_adaptor", "config_from_args", "freeze_heap", "functional_adaptor",
           "load_config", "main", "model_info_from_bundle", "open_device_for", "register",
           "sd_notify"]
