"""A task image's reference is parsed once, where it enters, into ``ImageRef``
(atropos/sandbox/contract/imageref.py), and carried as that type: its kind and its bound are decided
there and nowhere else (issue 37, item 5)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from atropos.api.server import SlotLeaseRequest
from atropos.errors import ImageRejected
from atropos.sandbox.contract.imageref import MAX_IMAGE_REFERENCE, ImageRef
from atropos.sandbox.contract.protocol import ImageRequest, ResetRequest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("text", "kind", "host_side"), [
    ("repo/task:tag", "engine", False), ("python:3.11-slim", "engine", False),
    ("oci:/srv/layouts/a", "oci", True), ("oci:/srv/layouts/a:v1", "oci", True),
    ("derived:" + "ab" * 32, "derived", True), ("docker://127.0.0.1:5000/r/t:1", "registry", False),
])
def test_a_reference_is_parsed_into_its_kind(text: str, kind: str, host_side: bool) -> None:
    ref = ImageRef.parse(text)
    assert ref == text and isinstance(ref, str) and ref.kind == kind and ref.host_side is host_side
    assert ImageRef.parse(ref) is ref  # parsed once: a parsed one is taken as it is


DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "fixed"), [
    ("repo/task:tag", False), ("repo/task", False), (f"repo/task@{DIGEST}", True), (DIGEST, True),
    (f"repo/task:{DIGEST[7:]}", False), ("oci:/srv/a:v1", False), (f"oci:/srv/a@{DIGEST}", False),
    ("derived:" + "ab" * 32, True), ("docker://127.0.0.1:5000/r/t:1", False),
    (f"docker://127.0.0.1:5000/r/t@{DIGEST}", True), (f"docker://127.0.0.1:5000/r/t:1@{DIGEST}", True),
    (f"docker://127.0.0.1:5000/r/t@{DIGEST}x", False),
])
def test_a_reference_that_may_move_is_told_from_one_that_cannot(text: str, fixed: bool) -> None:
    """A pool keeps a warm slot of a ``fixed`` reference without asking its host (the same image
    for good); any other may name another image at the next lease (tests/test_image_moving_refs.py)."""
    assert ImageRef.parse(text).fixed is fixed


@pytest.mark.parametrize("text", ["", "x" * (MAX_IMAGE_REFERENCE + 1), "a\0b", "oci:"])
def test_what_is_no_reference_is_refused_by_the_error_table(text: str) -> None:
    with pytest.raises(ImageRejected):
        ImageRef.parse(text)


def test_the_bound_is_the_same_in_every_request_model() -> None:
    longest = "r/" + "x" * (MAX_IMAGE_REFERENCE - 2)
    for build in (lambda v: ResetRequest(lease="l", image=v).image, lambda v: ImageRequest(reference=v).reference,
                  lambda v: SlotLeaseRequest(trajectory_id="t", image=v).image):
        got = build(longest)
        assert isinstance(got, ImageRef) and got.kind == "engine"
        assert build("oci:/x:v1").kind == "oci"  # type: ignore[union-attr]
        for bad in (longest + "x", "", "oci:", "a\0b"):
            with pytest.raises(ValidationError):
                build(bad)


def test_a_request_carries_it_as_the_text_given() -> None:
    req = ResetRequest(lease="l", image="oci:/srv/a:v1")
    assert req.model_dump_json(exclude_none=True) == '{"lease":"l","image":"oci:/srv/a:v1"}'
    again = ResetRequest.model_validate_json(req.model_dump_json())
    assert again.image == "oci:/srv/a:v1" and again.image.kind == "oci"  # type: ignore[union-attr]


def test_an_oci_reference_names_its_layout_and_tag(tmp_path: Path) -> None:
    assert ImageRef.parse(f"oci:{tmp_path}/lay:v1").oci_layout() == (tmp_path / "lay", "v1")
    assert ImageRef.parse(f"oci:{tmp_path}/lay").oci_layout() == (tmp_path / "lay", None)
    colon = tmp_path / "a:b"
    colon.mkdir()
    assert ImageRef.parse(f"oci:{colon}").oci_layout() == (colon, None)  # a directory that exists wins
    with pytest.raises(ImageRejected):
        ImageRef.parse("repo/task:tag").oci_layout()


def test_no_module_parses_a_reference_by_its_prefix_again() -> None:
    """The prefixes and the bound are spelled in imageref.py only (a new kind is one place)."""
    prefix = re.compile(r"""startswith\(\(?["'](oci:|derived:|docker://)|max_length=512|> 512\b""")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in (ROOT / "atropos").rglob("*.py")
             if path.name != "imageref.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if prefix.search(line)]
    assert found == []
