import pytest

from parallelkit import MeshError, MeshSpec


def test_parses_seed_format_from_list_and_json_string():
    assert MeshSpec.parse([[2, 2], ["fsdp", "tp"]]) == MeshSpec((2, 2), ("fsdp", "tp"))
    assert MeshSpec.parse('[[2, 2], ["fsdp", "tp"]]') == MeshSpec((2, 2), ("fsdp", "tp"))
    assert MeshSpec.parse(([2], ("fsdp",))).names == ("fsdp",)


def test_minus_one_takes_what_is_left_of_the_world():
    spec = MeshSpec.parse([[-1, 2], ["fsdp", "tp"]]).resolve(num_nodes=2, devices=4)
    assert spec.sizes == (4, 2)


def test_product_mismatch_states_arithmetic_and_a_fitting_shape():
    with pytest.raises(MeshError) as err:
        MeshSpec.parse([[2, 3], ["fsdp", "tp"]]).resolve(num_nodes=1, devices=4)
    message = str(err.value)
    assert "fsdp=2 x tp=3 = 6 processes" in message and "world size is 4" in message
    assert '[[2, 2], ["fsdp", "tp"]]' in message


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [
        ([[2, 2], ["fsdp", "fsdp"]], "repeats the axis 'fsdp'"),
        ([[0, 4], ["fsdp", "tp"]], "size 0"),
        ([[2, 2], ["fsdp", "model"]], "unknown axis 'model'"),
        ([[2, 2], ["tp", "fsdp"]], "outer to inner"),
        ([[-1, -1], ["fsdp", "tp"]], "at most one axis"),
        ([[2], ["fsdp", "tp"]], "1 sizes and 2 axis names"),
        ("[[2, 2], [fsdp, tp]]", "not valid JSON"),
        ([[2.5], ["fsdp"]], "not an integer"),
    ],
)
def test_bad_shapes_are_named_errors(shape, fragment):
    with pytest.raises(MeshError, match=fragment.replace("(", r"\(")):
        MeshSpec.parse(shape)


def test_minus_one_that_cannot_divide_the_world():
    with pytest.raises(MeshError, match="other axes need 4 processes"):
        MeshSpec.parse([[2, -1, 2], ["pp", "fsdp", "tp"]]).resolve(num_nodes=1, devices=6)


def test_tp_across_nodes_warns():
    with pytest.warns(UserWarning, match="tp=8 across nodes"):
        MeshSpec.parse([[2, 8], ["fsdp", "tp"]]).resolve(num_nodes=4, devices=4)


def test_coordinates_are_row_major_with_tp_innermost():
    spec = MeshSpec.parse([[2, 2, 2], ["replicate", "fsdp", "tp"]])
    assert spec.coordinates(5) == {"replicate": 1, "fsdp": 0, "tp": 1}
    assert [spec.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert spec.dp_size == 4 and spec.size("pp") == 1


def test_pipeline_ranks_share_data_parallel_rank():
    spec = MeshSpec.parse([[2, 2], ["pp", "fsdp"]])
    assert [spec.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_ep_is_a_data_parallel_axis_between_fsdp_and_tp():
    spec = MeshSpec.parse([[2, 2, 2], ["fsdp", "ep", "tp"]])
    assert spec.dp_size == 4  # every fsdp x ep rank sees its own samples; tp ranks share them
    assert [spec.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert spec.coordinates(6) == {"fsdp": 1, "ep": 1, "tp": 0}
    with pytest.raises(MeshError, match=r"they go outer to inner as \['fsdp', 'ep', 'tp'\]"):
        MeshSpec.parse([[2, 2, 2], ["fsdp", "tp", "ep"]])
