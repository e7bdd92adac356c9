"""Plans shared by tests: a compact builder and the worked example's vectors."""
from malleus_svc.plan import Pipeline, Plan, Stage


def make_plan(pipes, suspended=(), excluded=(), num_devices=16, layers=32, gpn=8, mbs=1):
    """pipes: [([(devices, (start, end)), ...], micro_batches), ...]"""
    return Plan(num_devices=num_devices, num_layers=layers, micro_batch_size=mbs, gpus_per_node=gpn,
                pipelines=tuple(Pipeline(tuple(Stage(tuple(d), tuple(l)) for d, l in stages), m)
                                for stages, m in pipes),
                suspended=tuple(suspended), excluded=tuple(excluded))


# The worked example: the healthy baseline (DP2-TP4-PP2 on 16 devices, 32 blocks) ...
BASELINE = make_plan([
    ([((0, 1, 2, 3), (0, 16)), ((4, 5, 6, 7), (16, 32))], 32),
    ([((8, 9, 10, 11), (0, 16)), ((12, 13, 14, 15), (16, 32))], 32),
])
# ... and its plan 1: p0 = {7},{15},{4,6},{0-3} with blocks 4,4,8,16; p1 = {8-11},{12,14}.
PLAN_1 = make_plan([
    ([((7,), (0, 4)), ((15,), (4, 8)), ((4, 6), (8, 16)), ((0, 1, 2, 3), (16, 32))], 43),
    ([((8, 9, 10, 11), (0, 16)), ((12, 14), (16, 32))], 21),
], suspended=(5, 13))
