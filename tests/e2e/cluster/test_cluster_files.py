"""The notebook's folder on every node: a cell on the cluster imports the notebook's own modules
and reads its small files by relative path, from Ray's package of the folder unpacked on each node
(launch/cluster/notebook_folder.py).

The test cluster's nodes share this machine's disk, so every test checks where a module came from:
its ``__file__`` lies in Ray's runtime-environment folder of the node, never in the notebook's
folder. The listing's rules are checked without a cluster, against Ray's own packing.
"""

from __future__ import annotations

import ast
import os
import re
import zipfile
from pathlib import Path

import pytest
from support.cluster import HEADER, header, leftovers, own_ray
from support.kernel import Kernel

ray = pytest.importorskip("ray")

from taas_magic.errors import TaasUsageError  # noqa: E402
from taas_magic.launch.cluster import notebook_folder  # noqa: E402

SHOW = """import mymod
print('module', mymod.VALUE, mymod.__file__, open('data.txt').read().strip().replace(chr(10), '|'), flush=True)
"""
UNPACKED = re.compile(r"/runtime_resources/working_dir_files/_ray_pkg_[0-9a-f]+/mymod\.py$")


@pytest.fixture(scope="module")
def kernel(cluster):
    local, config = cluster
    k = Kernel(
        {"TAAS_CLUSTER": local.address, "TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo"}, warm_fork_server=False
    )
    yield k
    k.shutdown()


@pytest.fixture
def notebook(kernel, tmp_path):
    """A notebook's folder, the kernel's current directory for the test: mymod.py and data.txt."""
    (tmp_path / "mymod.py").write_text("VALUE = 1\n")
    (tmp_path / "data.txt").write_text("hello from the notebook\n")
    kernel.execute(f"os.chdir({str(tmp_path)!r})").ok()
    return tmp_path


def sparse(path: Path, size: int) -> None:
    """A file of ``size`` bytes that takes no room (nothing reads it: it stays behind)."""
    path.write_bytes(b"")
    os.truncate(path, size)


def shown(result) -> list[tuple[str, str, str]]:
    """(VALUE, mymod.__file__, data.txt) as each rank printed them."""
    return [found.groups() for found in re.finditer(r"\] module (\S+) (\S+) (.*)", result.each_rank())]


def test_a_cell_imports_the_notebook_s_module_from_the_package_on_each_node_and_an_edit_arrives_next(kernel, notebook):
    r = kernel.execute(HEADER + SHOW, timeout=240).ok()
    first = shown(r)
    assert len(first) == 4 and {value for value, _, _ in first} == {"1"}, r.stdout
    assert {text for _, _, text in first} == {"hello from the notebook"}
    assert all(UNPACKED.search(path) and not path.startswith(str(notebook)) for _, path, _ in first), first
    assert "copied into this notebook's folder" not in r.stderr, "the notebook's own files are not sent back"

    (notebook / "mymod.py").write_text("VALUE = 2\n")
    r = kernel.execute(
        HEADER + SHOW + "if int(os.environ['RANK']) == 0:\n"
        "    open('data.txt', 'a').write('and from rank 0\\n')\n"
        "    open('result.txt', 'w').write('written on the node')\n",
        timeout=60,
    ).ok()
    second = shown(r)
    assert {value for value, _, _ in second} == {"2"}, r.stdout
    assert {path for _, path, _ in second}.isdisjoint(path for _, path, _ in first), "a new package"
    assert re.search(r"taas: rank 0 wrote data\.txt, result\.txt on node \S+: copied", r.stderr), r.stderr
    assert "packaging.py" not in r.stderr, "Ray's own log lines about the new package stay out of the cell"
    assert (notebook / "result.txt").read_text() == "written on the node"
    assert (notebook / "data.txt").read_text() == "hello from the notebook\nand from rank 0\n"
    assert (notebook / "mymod.py").read_text() == "VALUE = 2\n"

    r = kernel.execute(HEADER + SHOW, timeout=60).ok()
    assert {(value, text) for value, _, text in shown(r)} == {("2", "hello from the notebook|and from rank 0")}, (
        "what came back travels with the next cell"
    )
    assert "copied into this notebook's folder" not in r.stderr
    assert not leftovers(kernel)


def test_without_rays_packing_functions_a_folder_with_files_is_one_line_and_an_empty_folder_needs_none(
    tmp_path, monkeypatch
):
    """The cluster driver's private use of Ray's packing (ray_private.packaging) gone, as a Ray release may take
    it: a folder with files to send fails in one line saying what to do; an empty folder needs no packing."""
    from taas_magic.launch.cluster import ray_private

    def gone():
        raise ImportError("ray._private.runtime_env.packaging moved")

    monkeypatch.setattr(ray_private, "packaging", gone)
    (tmp_path / "notebook").mkdir()
    (tmp_path / "notebook" / "mymod.py").write_text("x = 1\n")
    with pytest.raises(TaasUsageError) as raised:
        notebook_folder.Packages().package(notebook_folder.listing(str(tmp_path / "notebook")), print)
    line = str(raised.value)
    assert "\n" not in line and "packs folders differently from what taas knows (ImportError: ray._private" in line
    assert "run the cell from a folder with nothing to send" in line
    (tmp_path / "empty").mkdir()
    assert notebook_folder.Packages().package(notebook_folder.listing(str(tmp_path / "empty")), print) is None


def test_a_runtime_environment_task_finds_the_package_where_the_agents_unpacked_it(cluster, kernel, notebook):
    """Ray's own working_dir, asked by a task pinned to a node, unpacks to the folder the ranks import
    from: the agents put the package where Ray itself does (and this is the way on a Ray without
    the function they call)."""
    path = shown(kernel.execute(HEADER + SHOW, timeout=240).ok())[0][1]
    r = kernel.execute(
        own_ray(cluster[0].address) + "from taas_magic.launch.cluster import notebook_folder as nf\n"
        "uri = nf.Packages().package(nf.listing(os.getcwd()), print)\n"
        "node = [n['NodeID'] for n in ray.nodes() if n['Alive'] and 'taas:t.2' in n['Resources']][0]\n"
        "print('task', nf.unpacked_by_a_task(uri, node))",
        timeout=120,
    ).ok()
    assert f"task {os.path.dirname(path)}" in r.stdout, (path, r.stdout)


def test_what_stays_behind(kernel, notebook):
    """.taasignore, else .gitignore; virtual environments, caches, notebooks and large files always."""
    (notebook / ".taasignore").write_text("secret.txt\nlogs/\n")
    (notebook / ".gitignore").write_text("gitignored.txt\n")
    for path in [
        "secret.txt",
        "gitignored.txt",
        "logs/a.txt",
        "sub/kept.txt",
        ".venv/lib.py",
        "env/pyvenv.cfg",
        "__pycache__/mymod.cpython.pyc",
        ".ipynb_checkpoints/n.ipynb",
        "notes.ipynb",
        ".git/HEAD",
    ]:
        (notebook / path).parent.mkdir(parents=True, exist_ok=True)
        (notebook / path).write_text("x")
    sparse(notebook / "big.bin", notebook_folder.FILE_LIMIT)
    listed = "import glob\nprint('found', sorted(glob.glob('**', recursive=True, include_hidden=True)))"
    r = kernel.execute("#!t.2\n#pragma taas --gpus 1 --device cpu\n" + listed, timeout=240).ok()
    assert ast.literal_eval(r.stdout.split("found ", 1)[1].strip()) == [
        ".gitignore",
        ".taasignore",
        "data.txt",
        "gitignored.txt",
        "mymod.py",
        "sub",
        "sub/kept.txt",
    ], r.stdout
    assert "taas: big.bin (10.0 MiB) stays on this machine: files of 10.0 MiB or more do not travel" in r.stderr
    assert "big.bin" not in kernel.execute("#!t.2\n#pragma taas --gpus 1 --device cpu\npass", timeout=60).stderr, (
        "said once"
    )

    (notebook / ".taasignore").unlink()
    r = kernel.execute("#!t.2\n#pragma taas --gpus 1 --device cpu\n" + listed, timeout=60).ok()
    found = ast.literal_eval(r.stdout.split("found ", 1)[1].strip())
    assert "gitignored.txt" not in found and "secret.txt" in found and "logs/a.txt" in found, found


def test_a_folder_too_large_fails_in_one_line_naming_its_biggest_items_before_anything_starts(kernel, notebook):
    for index in range(11):
        (notebook / "data").mkdir(exist_ok=True)
        sparse(notebook / "data" / f"part{index}", notebook_folder.FILE_LIMIT - 1)
    (notebook / "images").mkdir()
    (notebook / "images" / "a.png").write_bytes(b"x" * 5000)
    r = kernel.execute(HEADER + "print('never')", timeout=60)
    assert r.error is not None and r.error["ename"] == "TaasUsageError", r.error
    message = r.error["evalue"]
    assert "\n" not in message and "never" not in r.stdout
    assert message == (
        f"the notebook's folder {notebook} has 110.0 MiB to send to the cluster's nodes, more than "
        "100.0 MiB; the biggest are data/ (110.0 MiB), images/ (4.9 KiB), data.txt (24 bytes): list "
        f"what the ranks do not need in {notebook}/.taasignore (gitignore syntax, such as data/), "
        "or run the notebook from a smaller folder"
    ), message
    # Nothing started: no agent, no rank. The time may include this kernel's first connection to the cluster
    # (about 10 s on a busy machine when no test before it connected); starting the agents takes far longer.
    assert r.seconds < 20 and not leftovers(kernel)
    (notebook / ".taasignore").write_text("data/\n")
    kernel.execute(HEADER + "print('fits')", timeout=60).ok()


def test_a_session_keeps_the_package_it_started_with_and_says_the_folder_changed(kernel, notebook):
    r = kernel.execute(header("--keep") + SHOW, timeout=240).ok()
    try:
        assert {value for value, _, _ in shown(r)} == {"1"}
        (notebook / "mymod.py").write_text("VALUE = 2\n")
        r = kernel.execute(
            "#pragma taas --return none\nimport importlib\nimportlib.reload(mymod)\n" + SHOW, timeout=60
        ).ok()
        assert {value for value, _, _ in shown(r)} == {"1"}, r.stdout
        assert (
            "taas: mymod.py changed in the notebook's folder since the session started; its ranks keep the "
            "files they started with (%taas stop, then start the session again" in r.stderr
        ), r.stderr
        r = kernel.execute("#pragma taas --return none\npass", timeout=60).ok()
        assert "changed in the notebook's folder" not in r.stderr, "said once"
    finally:
        kernel.execute("%taas stop").ok()
    r = kernel.execute(HEADER + SHOW, timeout=60).ok()
    assert {value for value, _, _ in shown(r)} == {"2"}
    assert not leftovers(kernel)


# -- the listing, without a cluster ---------------------------------------------------------------


def test_ray_packs_exactly_what_the_listing_says_even_for_names_with_pattern_characters(tmp_path):
    from ray._private.runtime_env import packaging

    for path in [
        "m.py",
        "we[ird]/f*.txt",
        "!bang.py",
        "#hash.py",
        "sub/a?.txt",
        "sub/.gitignore",
        "sub/x.log",
        "skip/y.txt",
        "link_target.txt",
    ]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(path)
    (tmp_path / "sub" / ".gitignore").write_text("*.log\n")
    (tmp_path / ".gitignore").write_text("skip/\n")
    (tmp_path / "link.txt").symlink_to(tmp_path / "link_target.txt")
    (tmp_path / "folder_link").symlink_to(tmp_path / "sub")
    os.mkfifo(tmp_path / "fifo")
    found = notebook_folder.listing(str(tmp_path))
    assert [path for path, _, _ in found.files] == [
        "!bang.py",
        "#hash.py",
        ".gitignore",
        "link.txt",
        "link_target.txt",
        "m.py",
        "sub/.gitignore",
        "sub/a?.txt",
        "we[ird]/f*.txt",
    ]
    assert found.behind == ["fifo", "folder_link", "skip", "sub/x.log"]
    package = tmp_path.parent / f"{tmp_path.name}.zip"
    packaging.create_package(str(tmp_path), package, include_gitignore=False, excludes=found.excludes())
    packed = sorted(name for name in zipfile.ZipFile(package).namelist() if not name.endswith("/"))
    assert packed == [path for path, _, _ in found.files]


def test_the_listing_changes_with_an_edit_and_names_it(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\n")
    before = notebook_folder.listing(str(tmp_path))
    assert notebook_folder.listing(str(tmp_path)).fingerprint() == before.fingerprint()
    (tmp_path / "m.py").write_text("a = 22\n")
    (tmp_path / "new.txt").write_text("")
    after = notebook_folder.listing(str(tmp_path))
    assert after.fingerprint() != before.fingerprint() and after.changed_since(before) == ["m.py", "new.txt"]


def test_a_folder_of_too_many_files_is_refused_naming_where_they_are(tmp_path, monkeypatch):
    monkeypatch.setattr(notebook_folder, "FILES_LIMIT", 5)
    for index in range(4):
        (tmp_path / "many").mkdir(exist_ok=True)
        (tmp_path / "many" / str(index)).write_text("")
        (tmp_path / f"top{index}").write_text("")
    with pytest.raises(TaasUsageError) as raised:
        notebook_folder.check(notebook_folder.listing(str(tmp_path)))
    assert str(raised.value).startswith(
        f"the notebook's folder {tmp_path} has more than 5 files to send to the "
        "cluster's nodes; the most are in many/ (4 files), top0 (1 file): list"
    )


def test_shipping_the_notebook_s_folder_talked_beyond_loopback_to_nobody(cluster, peers):
    """Last in this module: packing, uploading and unpacking the notebook's folder (and Ray Client's
    upload) reached no peer beyond loopback but the machine's name server, as in test_cluster.py."""
    assert not peers.beyond_loopback(), peers.beyond_loopback()
