"""Object URLs as locations (merger/io/locations.py): the path algebra sources rely on behaves as pathlib's.

Oracle: PurePosixPath on the key, and the names users type. No storage is touched: only the algebra.
"""
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from merger.errors import MergerError
from merger.io import is_remote, location, relative_name
from merger.io.locations import ObjectPath

pytestmark = pytest.mark.unit

_part = st.text(alphabet="abcxyz019_-.", min_size=1, max_size=8).filter(lambda p: p not in (".", ".."))


@given(st.lists(_part, min_size=2, max_size=5), _part)
def test_algebra_matches_pathlib_on_the_key(parts, child):
    key = "/".join(parts)
    where, pure = location(f"s3://{key}"), PurePosixPath(key)
    assert isinstance(where, ObjectPath) and str(where) == f"s3://{key}"
    assert (where.name, where.stem, where.suffix) == (pure.name, pure.stem, pure.suffix)
    assert str(where.parent) == f"s3://{pure.parent}"
    assert str(where / child) == f"s3://{pure / child}"
    assert [str(p) for p in where.parents] == [f"s3://{p}" for p in pure.parents][:-1]  # the bucket is the top
    assert where.parent in (where / child).parents and where / child != where
    assert relative_name(str(where / child), where) == child
    assert (where / child).relative_to(where) == Path(child)


def test_local_paths_stay_paths_and_unknown_schemes_are_refused():
    assert location("/data/ckpt") == Path("/data/ckpt") and location("file:///data/ckpt") == Path("/data/ckpt")
    assert not is_remote("/data/ckpt") and not is_remote(Path("/data/ckpt")) and is_remote("s3://b/k")
    assert location("s3://b/run//step/../step/") == location("s3://b/run/step")
    with pytest.raises(MergerError, match=r"ftp:// paths are not supported"):
        location("ftp://host/ckpt")
    with pytest.raises(MergerError, match="names no bucket"):
        location("s3://")
