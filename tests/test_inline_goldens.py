"""Small partitions pinned inline, as PyTorch's own tests pin graphs: ``expecttest.TestCase.assertExpectedInline``
over ``sacpass.testing.golden_text`` (forward, backward and saved set). ``EXPECTTEST_ACCEPT=1 python -m pytest
tests/test_inline_goldens.py`` rewrites the literals in this file; review their diff like any other change.
The larger cases keep their files (tests/test_golden.py, tests/expected_graphs/)."""
import expecttest
import pytest
import torch

from sacpass.testing import ACCEPT_ENV, golden_text
from tests.support.fuzz_ops import D, Program, compile_program
from tests.support.golden_cases import build

pytestmark = pytest.mark.golden
TOY_TOPK = "sacpass_toy::topk_ids"


def _partition(program: Program, **options):
    """The one partition of ``program`` (a FuzzModel) compiled with a sacpass backend of ``options`` and run
    forward and backward once."""
    be, model = compile_program(program, **options)
    model(torch.randn(8, D, requires_grad=True)).sum().backward()
    (result,) = be.results
    return result


class SmallPartitions(expecttest.TestCase):
    maxDiff = None  # a failure shows the whole diff
    # the discrete-decision case's backend options (a test below changes them to show the pin failing)
    discrete_options: dict = {}

    def test_toy_layer_saved_set(self):
        """The toy DSA layer under save=[its top-k]: only the int32 IDs are saved besides the graph inputs."""
        self.assertExpectedInline(golden_text(build("toy_sacpass").reports[0]), """\
# graph g0
policy: Policy(save=[sacpass_toy::topk_ids], recompute=[], registered=[], defaults=[collectives(_c10d_functional)])
# saved
name       dtype[shape]     bytes  reason       op                             module   file
primals_1  float32[24, 32]  3072   graph input  input                          <root>   -
primals_4  float32[32, 32]  4096   graph input  input                          <root>   -
primals_5  float32[32, 32]  4096   graph input  input                          <root>   -
primals_6  float32[32, 32]  4096   graph input  input                          <root>   -
primals_7  float32[64, 32]  8192   graph input  input                          <root>   -
primals_8  float32[64]      256    graph input  input                          <root>   -
primals_9  float32[32, 64]  8192   graph input  input                          <root>   -
topk_ids   int32[24, 4]     384    must-save    sacpass_toy::topk_ids.default  indexer  toy.py
total: 8 tensors, 32384 bytes
  activations: 1 tensors, 384 bytes on the device; graph inputs: 7 tensors, 32000 bytes
  graph input: 32000 bytes
  must-save: 384 bytes
# recomputed in backward
aten::_softmax.default x1
aten::_to_copy.default x1
aten::add.Tensor x1
aten::addmm.default x1
aten::bitwise_not.default x1
aten::bmm.default x2
aten::clamp.default x1
aten::ge.Scalar x1
aten::gelu.default x1
aten::index.Tensor x1
aten::masked_fill.Scalar x1
aten::mm.default x3
aten::mul.Tensor x1
aten::permute.default x10
aten::t.default x5
aten::unsqueeze.default x2
aten::view.default x8
# tagged
MUST_SAVE topk_ids sacpass_toy::topk_ids.default <- sacpass_toy::topk_ids (indexer)
MUST_RECOMPUTE ge aten::ge.Scalar <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE clamp aten::clamp.default <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE _to_copy aten::_to_copy.default <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE bitwise_not aten::bitwise_not.default <- derived from sacpass_toy::topk_ids (<root>)
""")

    def test_must_save_custom_op(self):
        """A no-grad custom top-k whose IDs index the activation, selected to save: the forward returns the
        IDs, the backward reads them and never calls the op."""
        result = _partition(Program(("nograd_ids", "sin"), ((0, 2),)), save=[TOY_TOPK])
        self.assertExpectedInline(golden_text(result), """\
# graph g0
policy: Policy(save=[sacpass_toy::topk_ids], recompute=[], registered=[], defaults=[discrete, collectives(_c10d_functional)])
# forward
primals_1: "f32[8, 8]" = input
topk_ids: "i32[8, 3]" = sacpass_toy.topk_ids.default(primals_1, primals_1, 3)  # MUST_SAVE (region 0)
ge: "b8[8, 3]" = aten.ge.Scalar(topk_ids, 0)  # MUST_RECOMPUTE (region 0)
unsqueeze: "b8[8, 3, 1]" = aten.unsqueeze.default(ge, -1)  # MUST_RECOMPUTE (region 0)
to_copy: "f32[8, 3, 1]" = aten._to_copy.default(unsqueeze, dtype=torch.float32)  # MUST_RECOMPUTE (region 0)
clamp: "i32[8, 3]" = aten.clamp.default(topk_ids, 0)  # MUST_RECOMPUTE (region 0)
to_copy_1: "i64[8, 3]" = aten._to_copy.default(clamp, dtype=torch.int64)  # MUST_RECOMPUTE (region 0)
index: "f32[8, 3, 8]" = aten.index.Tensor(primals_1, [to_copy_1])
mul: "f32[8, 3, 8]" = aten.mul.Tensor(index, to_copy)
mean: "f32[8, 8]" = aten.mean.dim(mul, [1])
add: "f32[8, 8]" = aten.add.Tensor(primals_1, mean)
sin: "f32[8, 8]" = aten.sin.default(add)
return (sin, primals_1, topk_ids)
# backward
primals_1: "f32[8, 8]" = input
topk_ids: "i32[8, 3]" = input
tangents_1: "f32[8, 8]" = input
ge_1: "b8[8, 3]" = aten.ge.Scalar(topk_ids, 0)  # MUST_RECOMPUTE (region 0)
unsqueeze_1: "b8[8, 3, 1]" = aten.unsqueeze.default(ge_1, -1)  # MUST_RECOMPUTE (region 0)
to_copy_2: "f32[8, 3, 1]" = aten._to_copy.default(unsqueeze_1, dtype=torch.float32)  # MUST_RECOMPUTE (region 0)
clamp_1: "i32[8, 3]" = aten.clamp.default(topk_ids, 0)  # MUST_RECOMPUTE (region 0)
to_copy_3: "i64[8, 3]" = aten._to_copy.default(clamp_1, dtype=torch.int64)  # MUST_RECOMPUTE (region 0)
index_1: "f32[8, 3, 8]" = aten.index.Tensor(primals_1, [to_copy_3])
mul_1: "f32[8, 3, 8]" = aten.mul.Tensor(index_1, to_copy_2)
mean_1: "f32[8, 8]" = aten.mean.dim(mul_1, [1])
add_1: "f32[8, 8]" = aten.add.Tensor(primals_1, mean_1)
cos: "f32[8, 8]" = aten.cos.default(add_1)
mul_2: "f32[8, 8]" = aten.mul.Tensor(tangents_1, cos)
unsqueeze_2: "f32[8, 1, 8]" = aten.unsqueeze.default(mul_2, 1)
expand: "f32[8, 3, 8]" = aten.expand.default(unsqueeze_2, [8, 3, 8])
div: "f32[8, 3, 8]" = aten.div.Scalar(expand, 3)
mul_3: "f32[8, 3, 8]" = aten.mul.Tensor(div, to_copy_2)
new_zeros: "f32[8, 8]" = aten.new_zeros.default(mul_3, [8, 8], dtype=torch.float32, layout=torch.strided, device=device('DEVICE'))
index_put: "f32[8, 8]" = aten.index_put.default(new_zeros, [to_copy_3], mul_3, True)
add_2: "f32[8, 8]" = aten.add.Tensor(mul_2, index_put)
return (add_2,)
# saved
name       dtype[shape]   bytes  reason       op                             module  file
primals_1  float32[8, 8]  256    graph input  input                          <root>  -
topk_ids   int32[8, 3]    96     must-save    sacpass_toy::topk_ids.default  <root>  fuzz_ops.py
total: 2 tensors, 352 bytes
  activations: 1 tensors, 96 bytes on the device; graph inputs: 1 tensors, 256 bytes
  graph input: 256 bytes
  must-save: 96 bytes
# recomputed in backward
aten::_to_copy.default x2
aten::add.Tensor x1
aten::clamp.default x1
aten::ge.Scalar x1
aten::index.Tensor x1
aten::mean.dim x1
aten::mul.Tensor x1
aten::unsqueeze.default x1
# tagged
MUST_SAVE topk_ids sacpass_toy::topk_ids.default <- sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE ge aten::ge.Scalar <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE clamp aten::clamp.default <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE to_copy_1 aten::_to_copy.default <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE unsqueeze aten::unsqueeze.default <- derived from sacpass_toy::topk_ids (<root>)
MUST_RECOMPUTE to_copy aten::_to_copy.default <- derived from sacpass_toy::topk_ids (<root>)
""")

    def test_discrete_decision(self):
        """aten.topk inside a checkpoint, no selector: the default keeps its indices, narrowed to int32, and
        the backward rebuilds the values with a gather."""
        result = _partition(Program(("mm", "topk"), ((0, 2),)), **self.discrete_options)
        self.assertExpectedInline(golden_text(result), """\
# graph g0
policy: Policy(save=[], recompute=[], registered=[], defaults=[discrete, collectives(_c10d_functional)])
# forward
primals_1: "f32[8, 8]" = input
primals_2: "f32[8, 8]" = input
mm: "f32[8, 8]" = aten.mm.default(primals_1, primals_2)
topk: "(f32[8, 3], i64[8, 3])" = aten.topk.default(mm, 3)  # MUST_SAVE (region 0)
getitem: "i64[8, 3]" = operator.getitem(topk, 1)  # MUST_SAVE (region 0)
convert_element_type: "i32[8, 3]" = prims.convert_element_type.default(getitem, torch.int32)  # MUST_SAVE (region 0)
convert_element_type_1: "i64[8, 3]" = prims.convert_element_type.default(convert_element_type, torch.int64)  # MUST_RECOMPUTE (region 0)
gather: "f32[8, 3]" = aten.gather.default(mm, -1, convert_element_type_1)
mean: "f32[8, 1]" = aten.mean.dim(gather, [-1], True)
add: "f32[8, 8]" = aten.add.Tensor(mm, mean)
sum: "f32[8, 1]" = aten.sum.dim_IntList(gather, [-1], True)
mul: "f32[8, 1]" = aten.mul.Tensor(sum, 0.1)
add_1: "f32[8, 8]" = aten.add.Tensor(add, mul)
return (add_1, primals_1, primals_2, convert_element_type)
# backward
primals_1: "f32[8, 8]" = input
primals_2: "f32[8, 8]" = input
convert_element_type: "i32[8, 3]" = input
tangents_1: "f32[8, 8]" = input
sum_1: "f32[8, 1]" = aten.sum.dim_IntList(tangents_1, [1], True)
mul_1: "f32[8, 1]" = aten.mul.Tensor(sum_1, 0.1)
expand: "f32[8, 3]" = aten.expand.default(mul_1, [8, 3])
new_zeros: "f32[8, 8]" = aten.new_zeros.default(expand, [8, 8])
convert_element_type_2: "i64[8, 3]" = prims.convert_element_type.default(convert_element_type, torch.int64)  # MUST_RECOMPUTE (region 0)
scatter_add: "f32[8, 8]" = aten.scatter_add.default(new_zeros, -1, convert_element_type_2, expand)
add_2: "f32[8, 8]" = aten.add.Tensor(scatter_add, tangents_1)
expand_1: "f32[8, 3]" = aten.expand.default(sum_1, [8, 3])
div: "f32[8, 3]" = aten.div.Scalar(expand_1, 3)
new_zeros_1: "f32[8, 8]" = aten.new_zeros.default(div, [8, 8])
scatter: "f32[8, 8]" = aten.scatter.src(new_zeros_1, -1, convert_element_type_2, div)
add_3: "f32[8, 8]" = aten.add.Tensor(add_2, scatter)
t: "f32[8, 8]" = aten.t.default(primals_1)
mm_1: "f32[8, 8]" = aten.mm.default(t, add_3)
t_1: "f32[8, 8]" = aten.t.default(primals_2)
mm_2: "f32[8, 8]" = aten.mm.default(add_3, t_1)
return (mm_2, mm_1)
# saved
name                  dtype[shape]   bytes  reason       op                  module  file
primals_1             float32[8, 8]  256    graph input  input               <root>  -
primals_2             float32[8, 8]  256    graph input  input               <root>  -
convert_element_type  int32[8, 3]    96     discrete     aten::topk.default  <root>  fuzz_ops.py
total: 3 tensors, 608 bytes
  activations: 1 tensors, 96 bytes on the device; graph inputs: 2 tensors, 512 bytes
  discrete: 96 bytes
  graph input: 512 bytes
# recomputed in backward
prims::convert_element_type.default x1
# tagged
MUST_SAVE topk aten::topk.default <- discrete (<root>)
MUST_SAVE getitem aten::topk.default <- discrete (<root>)
MUST_SAVE convert_element_type aten::topk.default <- discrete (int32) (<root>)
MUST_RECOMPUTE convert_element_type_1 prims::convert_element_type.default <- derived from discrete (<root>)
""")


def test_an_inline_pin_fails_when_the_partition_changes(monkeypatch):
    """The discrete-decision pin, run on a partition with the default off (``save_discrete=False``): the
    backward recomputes the top-k, and assertExpectedInline fails with a diff that shows it."""
    monkeypatch.delenv(ACCEPT_ENV, raising=False)  # compare: never write the changed text into the literal

    class WithoutTheDefault(SmallPartitions):
        discrete_options = {"save_discrete": False}

    with pytest.raises(AssertionError) as info:
        WithoutTheDefault("test_discrete_decision").test_discrete_decision()
    diff = str(info.value)
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert any("MUST_SAVE" in ln and "aten.topk.default" in ln for ln in removed), diff
    assert any("aten.topk.default" in ln for ln in added), diff
    assert "EXPECTTEST_ACCEPT=1" in diff  # expecttest's own advice
