"""The task images of tests/task_images.py (issue 29) have what they promise, seen through ``docker run``
(the reference image-rooted slots are compared against) and through the layer store
(atropos/sandbox/host/images/), where a slot's root will come from.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from atropos.sandbox.host.images.layer_store import LayerStore
from atropos.sandbox.host.images.sources import ImportedImage, import_from_docker
from tests import task_images
from tests.task_images import BASE_IMAGE, LAYERED, MUSL_LOADER, TESTBED_ENV, docker_run

pytestmark = pytest.mark.docker
TaskImage = Callable[[str], str]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep their owners: the store runs as root")


def run_ok(image: str, command: str) -> str:
    code, out, err = docker_run(image, command)
    assert code == 0, f"{command!r} in {image} exited {code}: {err}"
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LayerStore:
    """One store for the module's imports: the base layer is unpacked once for all images."""
    return LayerStore(tmp_path_factory.mktemp("store") / "s")


def layer_holding(image: ImportedImage, rel: str) -> Path:
    """The one layer of ``image`` (in the store) where ``rel`` exists as anything, even a whiteout."""
    found = [Path(p) for p in image.layers if os.path.lexists(Path(p) / rel)]
    assert len(found) == 1, f"{rel} in {len(found)} layers"
    return found[0]


# -- pyenv: a SWE-style task --------------------------------------------------------------------------
def test_pyenv_has_its_own_python_first_on_path_and_a_root_owned_testbed(task_image: TaskImage) -> None:
    image = task_image("pyenv")
    out = run_ok(image, "command -v python python3 pytest; python -c 'import sys; print(sys.prefix)'; "
                        "pwd; echo $TASK_ID; stat -c '%u:%g %a' /testbed; git status --porcelain | wc -l; "
                        "git log --format=%s; python -c 'import calc; print(calc.__file__)'")
    assert out.split("\n") == [
        f"{TESTBED_ENV}/bin/python", f"{TESTBED_ENV}/bin/python3", f"{TESTBED_ENV}/bin/pytest", TESTBED_ENV,
        "/testbed", "pyenv", "0:0 755", "0", "calc: initial", "/testbed/calc/__init__.py", ""]
    # the env's interpreter is a copy, not a link into /usr: it stays at its own absolute path
    assert run_ok(image, f"test -L {TESTBED_ENV}/bin/python || echo copy") == "copy\n"
    # the default root (this host's /usr) and the base image lack it
    assert not os.path.exists(TESTBED_ENV)
    assert docker_run(BASE_IMAGE, f"test -e {TESTBED_ENV} || test -e /testbed")[0] == 1


def test_pyenv_runs_its_tests_with_its_own_pytest_one_passes_one_fails(task_image: TaskImage) -> None:
    code, out, _ = docker_run(task_image("pyenv"), "pytest -q -p no:cacheprovider")
    assert code == 1, out
    assert "1 failed, 1 passed" in out and "test_sub" in out
    code, out, _ = docker_run(task_image("pyenv"),
                              "python -m pytest -q -p no:cacheprovider tests/test_calc.py::test_add")
    assert code == 0 and "1 passed" in out


def test_docker_run_takes_a_user_and_a_working_directory(task_image: TaskImage) -> None:
    assert docker_run(task_image("pyenv"), "id -u; pwd; touch /testbed/x", user="1000", workdir="/tmp")[:2] == (
        1, "1000\n/tmp\n")  # uid 1000 cannot write the root-owned /testbed


# -- syspkg: a system package the default root lacks --------------------------------------------------
def test_syspkg_has_a_package_the_default_root_and_the_base_lack(task_image: TaskImage) -> None:
    image = task_image("syspkg")
    labels = task_images.inspect_image(image)["Config"]["Labels"]  # type: ignore[index]
    package, command = labels["org.atropos.test-package"], labels["org.atropos.test-command"]
    out = run_ok(image, f"command -v {command}; dpkg-query -W -f='${{Status}}' {package}; {command} --version")
    assert out.startswith(f"/usr/bin/{command}\ninstall ok installed")
    assert shutil.which(command) is None
    assert docker_run(BASE_IMAGE, f"command -v {command}")[0] == 1


# -- nopython: no python at all -----------------------------------------------------------------------
def test_nopython_has_bash_and_coreutils_but_no_python(task_image: TaskImage) -> None:
    image = task_image("nopython")
    assert docker_run(image, "command -v python3")[0] == 1
    assert docker_run(image, "command -v python")[0] == 1
    out = run_ok(image, "echo ${BASH_VERSION%%.*}; pwd; id -u; printf 'b\\na\\n' | sort | tr '\\n' ,; echo; "
                        "stat -c %a /tmp; find / -xdev -name 'python*' | wc -l; ls /lib64 /lib 2>/dev/null | wc -l")
    assert out == "5\n/root\n0\na,b,\n1777\n0\n0\n"  # no dynamic loader either: every program is static


# -- layered: whiteouts and opaque directories across layers ------------------------------------------
def test_layered_image_shows_deletions_replacements_and_overwrites(task_image: TaskImage) -> None:
    w = LAYERED
    out = run_ok(task_image("layered"), f"ls -A {w['replaced']}; cat {w['overwritten']} {w['kept']}; "
                                        f"for p in {w['deleted']} {w['deleted_dir']} {w['base_deleted']}; do "
                                        "test -e $p && echo $p; done; true")
    assert out == "new\nv2\nkeep\n"
    assert run_ok(BASE_IMAGE, f"cat {w['base_deleted']} >/dev/null && echo there") == "there\n"


# -- many: images sharing the base layer --------------------------------------------------------------
def test_many_images_are_distinct_and_share_the_base_layer(many_images: Callable[[int], list[str]]) -> None:
    refs = many_images(3)
    layers = [task_images.inspect_image(r)["RootFS"]["Layers"] for r in refs]  # type: ignore[index]
    base = task_images.inspect_image(BASE_IMAGE)["RootFS"]["Layers"]  # type: ignore[index]
    assert all(lay[:-1] == base for lay in layers) and len({lay[-1] for lay in layers}) == 3
    assert len({task_images.image_id(r) for r in refs}) == 3
    assert [run_ok(r, "cat /task/id; echo $TASK_ID") for r in refs] == [f"many-{i:05d}\nmany\n" for i in range(3)]


# -- musl: a root with musl's loader and no glibc -----------------------------------------------------
def test_musl_image_runs_a_program_linked_against_musl_and_has_no_glibc(task_image: TaskImage) -> None:
    image = task_image("musl")
    out = run_ok(image, "musl-hello a; ldd /usr/bin/musl-hello; ls /lib64 2>&1; command -v python3 || echo none")
    lines = out.splitlines()
    assert lines[0] == "musl-hello Linux argc=2"
    assert any(line.split()[:3] == ["libc.so", "=>", MUSL_LOADER] for line in lines)  # musl's ldd, musl's libc
    assert "No such file" in out and lines[-1] == "none"
    assert not os.path.exists(MUSL_LOADER)  # the default root (glibc) could not start the program


# -- the recipes' cache -------------------------------------------------------------------------------
def test_a_second_ensure_builds_nothing_and_a_changed_recipe_has_another_key(task_image: TaskImage) -> None:
    task_image("layered")
    again = task_images.ensure("layered")
    assert not again.built and again.image_id == task_images.image_id(task_images.ref("layered"))
    recipe = task_images.RECIPES["layered"]()
    base_id = task_images.ensure_base()
    assert again.reference == task_images.ref("layered", recipe.key(base_id))
    recipe.dockerfile += "RUN true\n"
    assert recipe.key(base_id) != task_images.RECIPES["layered"]().key(base_id)


# -- into the layer store -----------------------------------------------------------------------------
@root_only
def test_the_layered_image_in_the_store_has_overlayfs_whiteouts_and_opaque_dirs(
        task_image: TaskImage, store: LayerStore) -> None:
    image = import_from_docker(store, task_image("layered"))
    assert "TASK_ID=layered" in image.config.env and len(image.layers) == 5  # the base and four RUNs
    w = {k: v.lstrip("/") for k, v in LAYERED.items()}
    _, made, removed, remade, _ = map(Path, image.layers)  # the RUNs of the recipe, in order
    for path in (w["deleted"], w["deleted_dir"], w["base_deleted"]):
        st = os.lstat(removed / path)
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0), path
    assert (made / w["deleted"]).read_text() == "a\n" and (made / w["deleted_dir"] / "sub/f").is_file()
    first, replaced = made / w["replaced"], remade / w["replaced"]
    assert sorted(os.listdir(first)) == ["old1", "old2"] and sorted(os.listdir(replaced)) == ["new"]
    assert os.getxattr(replaced, "trusted.overlay.opaque") == b"y"
    assert os.getxattr(replaced, "user.overlay.opaque") == b"y"
    assert "trusted.overlay.opaque" not in os.listxattr(first)
    assert [(Path(p) / w["overwritten"]).read_text() for p in image.layers
            if (Path(p) / w["overwritten"]).is_file()] == ["v1\n", "v2\n"]


@root_only
def test_pyenv_nopython_syspkg_and_musl_in_the_store(task_image: TaskImage, store: LayerStore) -> None:
    pyenv = import_from_docker(store, task_image("pyenv"))
    assert pyenv.config.working_dir == "/testbed" and "TASK_ID=pyenv" in pyenv.config.env
    assert any(e.startswith(f"PATH={TESTBED_ENV}/bin:") for e in pyenv.config.env)
    python = layer_holding(pyenv, TESTBED_ENV.lstrip("/") + "/bin/python") / TESTBED_ENV.lstrip("/") / "bin/python"
    assert python.is_file() and not python.is_symlink()
    git = layer_holding(pyenv, "testbed/.git/HEAD") / "testbed"
    assert (git / ".git/HEAD").read_text() == "ref: refs/heads/main\n"
    assert git.stat().st_uid == 0 and (git / "calc/__init__.py").stat().st_uid == 0

    syspkg = import_from_docker(store, task_image("syspkg"))
    assert syspkg.unpacked <= 2 and syspkg.layers[0] == pyenv.layers[0]  # the base was already there
    command = task_images.inspect_image(task_image("syspkg"))["Config"]["Labels"]["org.atropos.test-command"]  # type: ignore[index]
    assert (Path(syspkg.layers[-1]) / "usr/bin" / command).is_file()

    nopy = import_from_docker(store, task_image("nopython"))
    assert len(nopy.layers) == 1 and nopy.config.working_dir == "/root"
    names = [n for _, dirs, files in os.walk(nopy.layers[0]) for n in dirs + files]
    assert "bash" in names and not [n for n in names if n.startswith("python")]

    musl = import_from_docker(store, task_image("musl"))
    root = Path(musl.layers[0])
    assert (root / MUSL_LOADER.lstrip("/")).is_file() and not (root / "lib64").exists()
    assert MUSL_LOADER.encode() in (root / "usr/bin/musl-hello").read_bytes()  # its ELF interpreter


def du(*paths: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", "-c", *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return int(out.splitlines()[-1].split()[0])


@root_only
def test_many_images_in_the_store_take_the_base_once_and_a_small_layer_each(
        many_images: Callable[[int], list[str]], tmp_path: Path) -> None:
    refs = many_images(10)
    store = LayerStore(tmp_path / "store")
    first = import_from_docker(store, refs[0])
    assert first.unpacked == 2
    one = du(store.root / "layers")
    rest = [import_from_docker(store, r) for r in refs[1:]]
    assert [im.unpacked for im in rest] == [1] * 9  # only the unique layer each time
    assert {im.layers[0] for im in rest} == {first.layers[0]}
    assert len(store.layers()) == 11
    ten = du(store.root / "layers")
    base = du(Path(first.layers[0]))
    print(f"\nlayer store du: base layer {base} B; 1 image {one} B; 10 images {ten} B "
          f"(+{(ten - one) // 9} B per further image)")
    assert ten - one <= 9 * 64 * 1024, "each further image should add only its tiny layer"
