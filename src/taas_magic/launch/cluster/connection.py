"""The cluster driver's connection to a Ray cluster: its nodes by configuration, placement, warm agents.

It runs in the cluster driver (``driver.py``), the process that is Ray's driver for the kernel. What
can be known of an address before connecting is ``address_checks.py`` (the kernel's too, without Ray);
which configuration a node fits, and what a run reserves on it, is ``nodes.py``.

A run takes its nodes whole through one placement group (one bundle per node, STRICT_SPREAD), so two
runs never share a node, and a run that cannot have its nodes is told so within seconds. The data
producers of a run's registered loaders take CPU nodes (c1.4) of their own in the same group.

Agents (``agent.NodeAgent``) are pinned to their node and kept between cells; they are owned by
the driver, so they die with it (and it with the kernel). One unused for ``idle_seconds`` leaves
on its own (the driver finds it gone when it next needs the node and starts another);
``%taas cluster release`` ends them all at once.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Mapping

from taas_magic.configurations import Catalog, Configuration
from taas_magic.errors import TaasUsageError, first_line
from taas_magic.launch.cluster import address_checks, authentication, ray_private
from taas_magic.launch.cluster.agent import NodeAgent, NodeInfo
from taas_magic.launch.cluster.nodes import LABEL, Node, bundle_for, free_count, holds, producer_nodes
from taas_magic.launch.cluster.notebook_folder import Packages
from taas_magic.process import containment

ENV_VAR = "TAAS_CLUSTER"
IDLE_VAR = "TAAS_CLUSTER_IDLE"
PLACEMENT_SECONDS = 8.0  # how long a run waits for busy nodes to free up before it is refused
AGENT_START_SECONDS = 120.0  # an agent's first answer waits for its Ray worker to start
AGENT_IDLE_SECONDS = 600.0  # an agent unused this long leaves (TAAS_CLUSTER_IDLE)
CHECK_SECONDS = 5.0  # a warm agent that does not answer this soon is replaced
LAUNCH_HOLD_SECONDS = 300.0  # the longest from a launch's first call to an agent to its run's start
FREE_SECONDS = 30.0  # how long Ray Client's kernel waits to learn which nodes are free
REUSE_SECONDS = 1.0  # a run right after another waits up to this long for Ray to see its nodes free
NAMESPACE = "taas"
AGENT_THREADS = 16  # an agent's calls at once: the kernel's (one at a time), and other nodes asking where to connect


def ray_module() -> Any:
    """Ray, imported quietly: in a notebook it warns about widgets that taas does not use. Whole or
    not at all, as torch is (kernel/runner.py): an interrupt waits for the import's end."""
    logging.getLogger("ray.widgets").setLevel(logging.WARNING)
    with warnings.catch_warnings(), containment.HeldInterrupts():
        warnings.simplefilter("ignore")
        try:
            import ray
        except ImportError:
            raise TaasUsageError(address_checks.NO_RAY) from None
    return ray


@dataclass
class Placement:
    """The nodes one run holds (its ranks' in node-rank order, then those that host its data
    producers alone), what it holds on each, and the placement group that holds them."""

    group: Any
    nodes: list[Node]
    bundles: list[dict[str, float]]
    hosts: int = 0  # the last nodes, for producers alone
    released: float | None = None  # when (time.monotonic) the group was removed

    def release(self) -> None:
        if self.released is None:
            ray_module().util.remove_placement_group(self.group)
            self.released = time.monotonic()

    def wait_until_free(self, timeout: float) -> None:
        """Until Ray counts the released nodes as free again (about 0.1 s after the release).

        A placement group asked for before that is not retried for about a second: a cell run
        right after another would wait for it.
        """
        ray = ray_module()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            available = _available_by_node(ray, max(deadline - time.monotonic(), 0.01))
            if available is not None and all(
                holds(available.get(node.node_id, {}), bundle) for node, bundle in zip(self.nodes, self.bundles)
            ):
                return
            time.sleep(0.01)


class Cluster:
    """A connected Ray cluster, as the kernel uses it."""

    def __init__(self, address: str):
        self.address = address
        self.agents: dict[str, Any] = {}  # node id -> its warm agent's actor handle
        self.last_placement: Placement | None = None
        self.idle_seconds = AGENT_IDLE_SECONDS
        self.owns_connection = False
        self.packages = Packages()  # the notebook's folder, as packages in this cluster's GCS

    @classmethod
    def connect(cls, address: str, idle_seconds: float = AGENT_IDLE_SECONDS) -> "Cluster":
        """Connect this kernel to the cluster at ``address`` (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``);
        agents unused for ``idle_seconds`` leave."""
        ray = ray_module()
        cluster = cls(address)
        cluster.idle_seconds = idle_seconds
        if not ray.is_initialized():
            host = address_checks.check(address)
            kwargs: dict[str, Any] = {}
            # The notebook runs on that node: Ray must not look for another address of this machine.
            if host is not None and address_checks.is_loopback(host):
                kwargs["_node_ip_address"] = host
            if host is not None:
                address_checks.check_token(address)
            if host is not None and address_checks.is_loopback(host):
                address_checks.check_a_node_is_at(address, host)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ray.init(
                        address=address,
                        namespace=NAMESPACE,
                        log_to_driver=False,
                        logging_level="ERROR",
                        include_dashboard=False,
                        **kwargs,
                    )
            except Exception as e:
                hint = authentication.client_hint(os.environ) if address.startswith("ray://") else ""
                raise TaasUsageError(
                    f"could not connect to the Ray cluster at {address!r}: {first_line(e)}{hint}"
                ) from None
            cluster.owns_connection = True
        return cluster

    # -- what the cluster has -------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        ray = ray_module()
        available = _available_by_node(ray)
        return [
            Node(
                info["NodeID"],
                info["NodeManagerAddress"],
                dict(info["Resources"]),
                None if available is None else available.get(info["NodeID"], {}),
            )
            for info in ray.nodes()
            if info.get("Alive")
        ]

    def _settle(self) -> None:
        """Until the nodes of a run released a moment ago show free again."""
        last = self.last_placement
        if last is not None and last.released is not None and time.monotonic() - last.released < REUSE_SECONDS:
            last.wait_until_free(REUSE_SECONDS)

    def describe(self, catalog: Catalog) -> str:
        """``%taas cluster``: the nodes by configuration, free or busy, and the warm agents."""
        self._settle()
        nodes = self.nodes()
        lines = [f"connected to the Ray cluster at {self.address}: {len(nodes)} node{'s' * (len(nodes) != 1)}"]
        for name in catalog.names():
            configuration = catalog.get(name)
            matching = [node for node in nodes if node.fits(configuration)]
            if matching:
                free = free_count(matching, configuration)
                warm = sum(node.node_id in self.agents for node in matching)
                free_text = "free unknown" if free is None else f"{free} free"
                lines.append(
                    f"  {name}: {len(matching)} node{'s' * (len(matching) != 1)} ({free_text}, "
                    f"{warm} with a warm agent): " + ", ".join(node.address for node in matching)
                )
        unmatched = [node for node in nodes if not any(node.fits(catalog.get(n)) for n in catalog.names())]
        if unmatched:
            lines.append(
                "  matching no configuration: " + ", ".join(f"{node.address} ({_shape(node)})" for node in unmatched)
            )
        return "\n".join(lines)

    # -- a run's nodes ----------------------------------------------------------------------------
    def place(
        self, configuration: Configuration, count: int, producers: int = 0, producer_node: Configuration | None = None
    ) -> Placement:
        """Hold ``count`` whole nodes of ``configuration`` for one run, and one ``producer_node`` node for
        each of its ``producers`` when the cluster has such nodes (else producers share the run's
        nodes), or say in one line why not."""
        ray = ray_module()
        from ray.util.placement_group import placement_group, placement_group_table

        nodes = self.nodes()
        matching = [node for node in nodes if node.fits(configuration)]
        if len(matching) < count:
            raise TaasUsageError(
                f"{count} node{'s' * (count != 1)} of {configuration.name} needed, the cluster has {len(matching)}"
                + (f" ({', '.join(node.address for node in matching)})" if matching else "")
                + f": add nodes that declare the Ray resource {LABEL}{configuration.name}, or ask for fewer ranks"
            )
        hosts = producer_nodes(nodes, configuration, producer_node, producers) if producer_node else []
        self._settle()
        bundles = [bundle_for(configuration, matching[0])] * count
        if hosts:
            assert producer_node is not None
            bundles += [bundle_for(producer_node, hosts[0])] * producers
        group = placement_group(bundles, strategy="STRICT_SPREAD")
        if not group.wait(timeout_seconds=PLACEMENT_SECONDS):  # asks the control store: no task, no worker
            ray.util.remove_placement_group(group)
            free = free_count([node for node in self.nodes() if node.fits(configuration)], configuration)
            message = f"{count} node{'s' * (count != 1)} of {configuration.name} needed, " + (
                f"{free} of the cluster's {len(matching)} are free now"
                if free is not None
                else f"the cluster did not say which of its {len(matching)} are free"
            )
            if hosts:
                assert producer_node is not None
                ids = {node.node_id for node in hosts}
                idle = free_count([node for node in self.nodes() if node.node_id in ids], producer_node)
                message += (
                    f"; {producers} of {producer_node.name} for data producers, "
                    f"{'?' if idle is None else idle} of {len(hosts)} free"
                )
            raise TaasUsageError(message + " (the others run other work): try again later")
        by_id = {node.node_id: node for node in nodes}
        bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
        chosen = [by_id[bundle_nodes[index]] for index in range(len(bundles))]
        self.last_placement = Placement(group, chosen, bundles, producers if hosts else 0)
        return self.last_placement

    def agents_on(self, nodes: list[Node], ours: tuple[str, str, str]) -> list[Any]:
        """The warm agent on each node; missing ones are started together, and checked to match the
        kernel's Python, torch and taas versions (``ours``) before anything of the run starts."""
        ray = ray_module()
        self._forget_dead([node.node_id for node in nodes if node.node_id in self.agents])
        missing = {node.node_id: self._start_agent(node) for node in nodes if node.node_id not in self.agents}
        try:
            answers = ray.get(
                [handle.info.remote(LAUNCH_HOLD_SECONDS) for handle in missing.values()], timeout=AGENT_START_SECONDS
            )
        except BaseException:
            for handle in missing.values():
                ray.kill(handle)
            raise
        mismatched: NodeInfo | None = None
        for (node_id, handle), info in zip(missing.items(), answers):
            if (info.python, info.torch, info.taas) != ours:
                mismatched = mismatched or info
                ray.kill(handle)
            else:
                self.agents[node_id] = handle
        if mismatched is not None:
            raise TaasUsageError(
                f"node {mismatched.address} runs Python {mismatched.python}, torch {mismatched.torch}, taas-magic "
                f"{mismatched.taas}; this kernel runs Python {ours[0]}, torch {ours[1]}, taas-magic {ours[2]}: "
                "install the same on every node"
            )
        return [self.agents[node.node_id] for node in nodes]

    def _forget_dead(self, node_ids: list[str]) -> None:
        """Warm agents that no longer answer (their node or worker died between cells) are replaced; those
        that answer stay for the launch (``NodeAgent.info``)."""
        ray = ray_module()
        pings = {node_id: self.agents[node_id].info.remote(LAUNCH_HOLD_SECONDS) for node_id in node_ids}
        for node_id, ping in pings.items():
            try:
                ray.get(ping, timeout=CHECK_SECONDS)
            except Exception:
                ray.kill(self.agents.pop(node_id))

    def _start_agent(self, node: Node) -> Any:
        ray = ray_module()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(NodeAgent).options(
            num_cpus=0,
            max_concurrency=AGENT_THREADS,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        )
        return actor.remote(self.idle_seconds)

    def forget(self, node_id: str) -> None:
        """An agent that died: the next run on its node starts a new one."""
        self.agents.pop(node_id, None)

    def release(self, keep: Collection[str] = ()) -> tuple[int, int]:
        """End the warm agents and their fork servers, but those on the nodes (ids) in ``keep``: they serve a
        session's ranks, which die with them. How many were ended, and how many kept."""
        ray = ray_module()
        handles = [handle for node_id, handle in self.agents.items() if node_id not in keep]
        self.agents = {node_id: handle for node_id, handle in self.agents.items() if node_id in keep}
        try:
            ray.get([handle.shutdown.remote() for handle in handles], timeout=15)
        except Exception:
            pass  # an agent that cannot say goodbye is killed below all the same
        for handle in handles:
            ray.kill(handle)
        return len(handles), len(self.agents)

    def disconnect(self) -> None:
        try:
            self.release()
        finally:
            if self.owns_connection:
                ray_module().shutdown()


def address_from(environ: Mapping[str, str]) -> str | None:
    return environ.get(ENV_VAR) or None


def idle_seconds_from(environ: Mapping[str, str]) -> float:
    """How long warm agents stay unused (``TAAS_CLUSTER_IDLE`` seconds); one line if that is no number."""
    text = environ.get(IDLE_VAR, "")
    if not text:
        return AGENT_IDLE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise TaasUsageError(f"{IDLE_VAR}={text!r} is not a number of seconds: use a positive number such as 600")
    return seconds


def _available_by_node(ray: Any, timeout: float = FREE_SECONDS) -> dict[str, dict[str, float]] | None:
    """What each node has free right now (Ray's own per-node view; it has no public call for it),
    or None when the cluster did not say.

    Through Ray Client the kernel has no view of its own: a task on the cluster looks for it. The
    first such task waits for a worker process to start on the cluster, seconds on a busy head.
    """
    try:
        if ray.util.client.ray.is_connected():
            return dict(ray.get(ray.remote(num_cpus=0)(free_resources).remote(), timeout=timeout))
        return free_resources()
    except Exception:
        return None


def free_resources() -> dict[str, dict[str, float]]:
    """Each node's free resources, as this process's connection to the cluster sees them."""
    return ray_private.free_resources_per_node()


def _shape(node: Node) -> str:
    gpus, cpus = int(node.resources.get("GPU", 0)), int(node.resources.get("CPU", 0))
    return f"{gpus} GPUs, {cpus} CPUs"


def kernel_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The kernel's variables that ranks on other machines get too: those that steer torch's
    communication and taas; the rest of the kernel's environment is the kernel's alone."""
    prefixes = ("NCCL_", "GLOO_", "TORCH_", "TAAS_", "CUBLAS_", "PYTHONHASHSEED", "CUDA_LAUNCH_BLOCKING")
    return {
        name: value
        for name, value in environ.items()
        if name.startswith(prefixes) and name not in (ENV_VAR, IDLE_VAR, "TAAS_CONFIG")
    }
