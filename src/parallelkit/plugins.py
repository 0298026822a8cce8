"""Entry-point discovery: strategies and comm hooks from every installed distribution, parallelkit's own included.

A distribution declares, in its pyproject.toml::

    [project.entry-points."parallelkit.strategies"]
    foo = "parallelkit_foo:FooStrategy"          # a lightning Strategy subclass, or a StrategyPreset

and after `pip install`, `foo` is in Lightning's StrategyRegistry by the time a Trainer reads it, so
`Trainer(strategy="foo")` works: `import parallelkit` arms the registry (`register_on_first_use`) and the plugins
load when it is first read, not on import. A plugin that fails to import, or whose name is already taken, is a
`PluginWarning` naming the distribution and the error; the others still load.

A plugin states the plugin API it was written against with a class attribute `plugin_api = 1` on its strategy
(or comm hook) class; when that is not this parallelkit's `PLUGIN_API`, the plugin is still registered and a
`PluginWarning` says which versions differ and how to fix it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from parallelkit.errors import PluginWarning

PLUGIN_API = 1
"""Version of what plugins build on: the entry-point groups, `ParallelkitStrategy`'s hooks, `StrategyPreset`,
`CommHook`, `MeshSpec`, `parallelize` and the checkpoint helpers. Raised when any of them changes incompatibly."""

STRATEGY_GROUP = "parallelkit.strategies"
COMM_HOOK_GROUP = "parallelkit.comm_hooks"
GROUPS = (STRATEGY_GROUP, COMM_HOOK_GROUP)
OWN_DISTRIBUTION = "parallelkit"


@dataclass(frozen=True)
class StrategyPreset:
    """A registered name for a strategy class with default arguments (`fsdp` = FSDPTPStrategy, all shard).

    An entry point in `parallelkit.strategies` may point at one of these instead of a class.
    """

    strategy: type
    description: str = ""
    init_params: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Plugin:
    """One entry point as found: where it comes from, and what loading it gave (`obj`) or why not (`error`)."""

    group: str
    name: str
    target: str
    distribution: str
    version: str
    obj: Any = None
    error: str | None = None

    @property
    def description(self) -> str:
        if isinstance(self.obj, StrategyPreset):
            return self.obj.description
        doc = getattr(self.obj, "__doc__", None) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}"


_found: dict[str, list[Plugin]] = {}


def _load(ep: EntryPoint, group: str) -> Plugin:
    dist = getattr(ep, "dist", None)
    # A distribution's name and version come from its METADATA file, which is missing while pip writes or removes
    # the distribution (its entry points already, or still, there): unknown then, as for an entry point with none.
    plugin = Plugin(
        group=group,
        name=ep.name,
        target=ep.value,
        distribution=getattr(dist, "name", None) or "<unknown>",
        version=getattr(dist, "version", None) or "?",
    )
    try:
        plugin.obj = ep.load()
    except Exception as err:  # noqa: BLE001 - any failure of third-party code must not break the host
        plugin.error = f"{type(err).__name__}: {err}"
    return plugin


def discover(group: str) -> list[Plugin]:
    """Load every entry point of `group` once per process; parallelkit's own first, then by distribution."""
    if group not in _found:
        seen: set[tuple[str, str]] = set()
        plugins = []
        for ep in entry_points(group=group):
            # The same distribution found twice on sys.path (e.g. an editable install and a build dir).
            if (ep.name, ep.value) not in seen:
                seen.add((ep.name, ep.value))
                plugins.append(_load(ep, group))
        plugins.sort(key=lambda p: (p.distribution != OWN_DISTRIBUTION, p.distribution, p.name))
        for plugin in plugins:
            if plugin.error:
                warnings.warn(
                    f"parallelkit plugin {plugin.name!r} ({group} = {plugin.target}) from distribution "
                    f"{plugin.origin} failed to load and is skipped: {plugin.error}. The other plugins are "
                    f"loaded; fix or uninstall {plugin.distribution} to silence this.",
                    PluginWarning,
                    stacklevel=2,
                )
        _found[group] = plugins
    return _found[group]


def check_api(plugin: Plugin, target: Any) -> None:
    """Warn when `target` (a plugin's class) declares a `plugin_api` other than this parallelkit's."""
    wanted = getattr(target, "plugin_api", None)
    if wanted is None or wanted == PLUGIN_API:
        return
    newer = isinstance(wanted, int) and wanted > PLUGIN_API
    fix = (
        f"upgrade parallelkit to one that provides plugin API {wanted}"
        if newer
        else f"upgrade {plugin.distribution} to a release written for plugin API {PLUGIN_API}"
    )
    warnings.warn(
        f"parallelkit plugin {plugin.name!r} from {plugin.origin} was written for parallelkit plugin API "
        f"{wanted!r}, but this parallelkit {_own_version()} provides plugin API {PLUGIN_API}. It is registered, but "
        f"may fail when used: {fix}.",
        PluginWarning,
        stacklevel=3,
    )


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(OWN_DISTRIBUTION)
    except PackageNotFoundError:
        return "(not installed)"


def _strategy_and_params(plugin: Plugin) -> tuple[type, dict[str, Any], str]:
    from lightning.pytorch.strategies import Strategy

    obj = plugin.obj
    if isinstance(obj, StrategyPreset):
        return obj.strategy, dict(obj.init_params), obj.description
    if isinstance(obj, type) and issubclass(obj, Strategy):
        return obj, {}, plugin.description
    raise TypeError(
        f"it resolves to {obj!r}, which is neither a lightning Strategy subclass nor a "
        "parallelkit.plugins.StrategyPreset"
    )


_registered_by: dict[str, str] = {}


def register_strategies() -> list[Plugin]:
    """Register every discovered strategy in Lightning's StrategyRegistry; safe to call again."""
    from lightning.pytorch.strategies import StrategyRegistry

    plugins = discover(STRATEGY_GROUP)
    for plugin in plugins:
        if plugin.error:
            continue
        try:
            strategy, params, description = _strategy_and_params(plugin)
        except TypeError as err:
            plugin.error = f"TypeError: {err}"
            warnings.warn(
                f"parallelkit plugin {plugin.name!r} from {plugin.origin} is skipped: {err}.",
                PluginWarning,
                stacklevel=2,
            )
            continue
        if plugin.name in StrategyRegistry:
            existing = StrategyRegistry[plugin.name]
            if existing["strategy"] is strategy and existing["init_params"] == params:
                continue  # registered by an earlier call in this process
            owner = _registered_by.get(plugin.name, f"lightning (its own {existing['strategy'].__name__})")
            plugin.error = f"name clash with {owner}"
            warnings.warn(
                f"parallelkit plugin strategy {plugin.name!r} from {plugin.origin} is skipped: the name is "
                f"already registered by {owner}. Rename the entry point in {plugin.distribution}'s "
                "pyproject.toml, or pass the strategy by class.",
                PluginWarning,
                stacklevel=2,
            )
            continue
        check_api(plugin, strategy)
        StrategyRegistry.register(plugin.name, strategy, description=description, **params)
        _registered_by[plugin.name] = plugin.origin
    return plugins


def comm_hooks() -> dict[str, Plugin]:
    """Every loadable comm hook plugin by name (first distribution wins a clash)."""
    hooks: dict[str, Plugin] = {}
    for plugin in discover(COMM_HOOK_GROUP):
        if plugin.error:
            continue
        if plugin.name in hooks:
            plugin.error = f"name clash with {hooks[plugin.name].origin}"
            warnings.warn(
                f"parallelkit comm hook {plugin.name!r} from {plugin.origin} is skipped: the name is already "
                f"provided by {hooks[plugin.name].origin}. Rename the entry point in {plugin.distribution}'s "
                "pyproject.toml, or pass the hook as an object.",
                PluginWarning,
                stacklevel=2,
            )
            continue
        check_api(plugin, plugin.obj)
        hooks[plugin.name] = plugin
    return hooks


_active = False


def activate() -> None:
    """Register every discovered strategy in Lightning's StrategyRegistry and quiet Lightning's known noise
    (`compat.quiet_known_noise`), once per process: what a Trainer given parallelkit's or a plugin's strategy needs,
    done when the first Trainer reads the registry (`register_on_first_use`), or by `parallelkit plugins`."""
    global _active
    if not _active:
        _active = True
        from parallelkit.compat import quiet_known_noise

        register_strategies()
        quiet_known_noise()


def register_on_first_use() -> None:
    """`activate` when Lightning's StrategyRegistry is first read (`compat.on_first_registry_read`), so that
    `import parallelkit` loads neither Lightning nor any plugin; a Lightning imported later is armed as its import
    ends (`_ArmWhenLightningLoads`)."""
    if "lightning" in sys.modules:
        from parallelkit.compat import on_first_registry_read

        on_first_registry_read(activate)
    elif not any(isinstance(finder, _ArmWhenLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ArmWhenLightningLoads())


class _ArmWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `lightning` is imported, its module runs as usual, then the registry is armed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def exec_module(module: object) -> None:
                execute(module)
                register_on_first_use()

            spec.loader.exec_module = exec_module
        return spec
