"""The ranks' agreement on the plan, on thread ranks over synthetic catalogs: the same catalog and plan pass, and
any rank whose files or plan differ stops every rank with the same line, naming the ranks and the first
difference."""
import pytest

from merger.engine.plan import plan_layout
from merger.engine.plan_agreement import agree_on_plan
from merger.errors import AgreedError
from tests.helpers.synthetic import run_in_threads, single_tensor_steps

pytestmark = pytest.mark.unit
FILES = [("rank_0.pt", 100), ("rank_1.pt", 100)]


def _agree(world: int, files_of, max_shard_of=lambda rank: 1 << 30) -> list[str | None]:
    """Each thread rank plans the same synthetic checkpoint with its own file list and shard size; what each
    rank raised (None: agreed)."""
    catalog, steps = single_tensor_steps(["a", "b", "c"])
    said: list[str | None] = [None] * world

    def body(group):
        plan = plan_layout(catalog, steps, group.world, max_shard_of(group.rank), 1 << 20)
        try:
            agree_on_plan(catalog, plan, group, files_of(group.rank))
        except AgreedError as e:
            said[group.rank] = str(e)

    run_in_threads(world, body)
    return said


def _line(difference: str) -> str:
    return (f"the ranks see different checkpoints: {difference}; every rank must see the same files (one shared "
            f"folder, or identical copies), /synthetic")


def test_the_same_files_and_plan_agree():
    assert _agree(3, lambda rank: list(FILES)) == [None] * 3


@pytest.mark.parametrize("files_of_rank_2, difference", [
    (FILES + [("rank_2.pt", 100)], "rank 2 sees 3 source files, rank 0 sees 2: rank_2.pt only on rank 2"),
    (FILES[:1], "rank 2 sees 1 source files, rank 0 sees 2: rank_1.pt only on rank 0"),
    ([FILES[0], ("rank_1.pt", 90)], "rank 2 sees 190 bytes of source files, rank 0 sees 200: rank_1.pt is 90 bytes "
                                    "on rank 2, 100 on rank 0"),
    ([FILES[0], ("rank_9.pt", 100)], "rank 2 and rank 0 see other source files: rank_1.pt only on rank 0"),
])
def test_a_rank_that_sees_other_files_stops_every_rank(files_of_rank_2, difference):
    said = _agree(3, lambda rank: files_of_rank_2 if rank == 2 else list(FILES))
    assert said == [_line(difference)] * 3


def test_another_plan_from_the_same_files_stops_every_rank():
    said = _agree(2, lambda rank: list(FILES), max_shard_of=lambda rank: 1 << 30 if rank == 0 else 4)
    assert said == [_line("rank 1 and rank 0 read the same files but planned other outputs (another config or "
                          "options?)")] * 2


def test_every_differing_rank_is_counted():
    said = _agree(4, lambda rank: list(FILES) if rank == 0 else FILES[:1])
    assert said == [_line("rank 1 sees 1 source files, rank 0 sees 2: rank_1.pt only on rank 0 (and 2 more "
                          "ranks)")] * 4
