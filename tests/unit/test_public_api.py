"""What users see of taas, locked: the names they import, the options they type, the settings they configure.

A change to any of these is a change users notice; it belongs in the changelog, not in a refactoring.
"""

from __future__ import annotations

import taas
import taas_magic
from taas_magic.kernel.header import options
from taas_magic.kernel.magics import TaasMagics
from taas_magic.local_cluster import LocalCluster


def test_the_taas_module_offers_what_notebooks_import() -> None:
    assert sorted(taas.__all__) == [
        "PerRank",
        "device",
        "is_main",
        "local_rank",
        "local_world_size",
        "progress",
        "rank",
        "register",
        "registered",
        "unregister",
        "world_size",
    ]
    assert all(callable(getattr(taas, name)) for name in taas.__all__)


def test_the_extension_offers_its_entry_points_and_errors() -> None:
    assert sorted(taas_magic.__all__) == [
        "RankFailed",
        "RunTimedOut",
        "TaasRunError",
        "TaasUsageError",
        "load_ipython_extension",
        "unload_ipython_extension",
    ]
    assert issubclass(taas_magic.RankFailed, taas_magic.TaasRunError)
    assert issubclass(taas_magic.RunTimedOut, taas_magic.TaasRunError)


def test_the_options_are_the_documented_ones_in_their_order() -> None:
    assert options.visible_options(TaasMagics.taas) == [
        "--gpus",
        "--config",
        "--device",
        "--start",
        "--on",
        "--cpus",
        "--units",
        "--order",
        "--prefetch",
        "--output",
        "--return",
        "--from",
        "--timeout",
        "--hang-after",
        "--profile",
        "--max-restarts",
        "--debug",
        "--debug-ranks",
        "--keep",
        "--ranks",
        "--idle",
        "--background",
    ]


def test_the_settings_of_config_are_the_documented_ones() -> None:
    assert sorted(TaasMagics.class_own_traits(config=True)) == [
        "device",
        "hang_after",
        "output",
        "start",
        "view",
        "warm_fork_server",
    ]


def test_a_local_cluster_is_importable_where_the_docs_say() -> None:
    assert LocalCluster.__module__ == "taas_magic.local_cluster"
