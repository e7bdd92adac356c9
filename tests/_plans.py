"""Plans shared by tests: a compact builder, the worked example's vectors, the migration cases and
random plans on 8 devices."""
from malleus_svc.config.presets import ModelShape
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


SHAPE_32 = ModelShape(layers=32, hidden=64, heads=4, ffn=128, vocab=256, seq_len=64)

# The Ray case: 8 devices, 2 logical nodes of 4. A: two pipelines, TP=2 groups, pipelines that
# cross nodes, device 7 suspended. B: three pipelines, TP 1 and 2 for layers that were at TP 2,
# layers moved between stages and nodes, device 2 suspended and device 7 back.
PLAN_A = make_plan([
    ([((0, 1), (0, 2)), ((4, 5), (2, 4))], 2),
    ([((2, 3), (0, 3)), ((6,), (3, 4))], 2),
], suspended=(7,), num_devices=8, layers=4, gpn=4, mbs=2)
PLAN_B = make_plan([
    ([((0,), (0, 4))], 1),
    ([((1, 3), (0, 3)), ((4,), (3, 4))], 2),
    ([((6, 7), (0, 2)), ((5,), (2, 4))], 1),
], suspended=(2,), num_devices=8, layers=4, gpn=4, mbs=2)


def random_plan(rng) -> Plan:
    """1-3 pipelines of 1-3 stages at TP 1, 2 or 4 on 8 devices (6 layers), the rest suspended."""
    devs = list(range(8))
    rng.shuffle(devs)
    while True:
        pipes, pos = [], 0
        for _ in range(rng.randint(1, 3)):
            k = rng.randint(1, 3)
            bounds = [0, *sorted(rng.sample(range(1, 6), k - 1)), 6]
            stages = []
            for j in range(k):
                size = rng.choice([1, 2, 4])
                stages.append((devs[pos:pos + size], (bounds[j], bounds[j + 1])))
                pos += size
            pipes.append((stages, rng.randint(1, 3)))
        if pos <= 8:
            return make_plan(pipes, suspended=devs[pos:], num_devices=8, layers=6, gpn=4)
