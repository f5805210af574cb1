"""Data parallel under torchrun, on this machine's CPU (gloo): two ranks against one process
that ran the same microbatches, resume across numbers of ranks, the mean over the ranks'
usable microbatches, ranks whose weights part (stopped by the loop's check), each rank's share
of a step's batches, and a rank that dies or hangs."""
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plumbing import distributed
import hetero_gpt as hg
import helpers
from helpers import FakeEngine, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# on the CPU the engines are the same with or without tools/fast_standin.py, so the copy without
# it (test_standin.py) has nothing to learn here
pytestmark = pytest.mark.skipif(os.environ.get('HETERO_WITHOUT_STANDIN') == '1', reason="no fast_standin.py on the CPU")
# 4 microbatches a step (2 a rank), both engines, the stand-in in fp32 so that every difference
# is rounding; min_lr = learning_rate: a constant rate after warm-up, so a run stopped at
# max_iters 4 and resumed to 8 takes the steps of a run straight to 8
RANKS = helpers.TINY | dict(gradient_accumulation_steps=4, learning_rate=3e-3, min_lr=3e-3, eval_iters=2,
                            eval_interval=4, log_interval=2, mode='hetero', ane_dtype='float32', ane_fraction=0.5)
HANG = 300  # seconds: far past any step here (a run of these reaches step 6 in seconds); only a hang fails on it


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def flags(data_dir, out_dir, *extra):
    return helpers.flags(data_dir, out_dir, RANKS) + list(extra)


def torchrun(n, data_dir, out_dir, *extra):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(n), '--master_port',
           str(free_port()), 'hetero_gpt.py'] + flags(data_dir, out_dir, *extra)
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS='1'), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ranks(n, data_dir, out_dir, *extra):
    """n processes started as torchrun starts them (its environment variables), without its agent
    (one process less on a 2-core machine); without the agent rank 0 holds the store."""
    env = dict(os.environ, OMP_NUM_THREADS='1', WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))
    cmd = [sys.executable, 'hetero_gpt.py'] + flags(data_dir, out_dir, *extra)
    return [subprocess.Popen(cmd, cwd=ROOT, env=env | dict(RANK=str(r), LOCAL_RANK=str(r)), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(n)]


def two_ranks(data_dir, out_dir, *extra):
    outs = [p.communicate(timeout=HANG) + (p.returncode,) for p in ranks(2, data_dir, out_dir, *extra)]
    assert all(rc == 0 for _, _, rc in outs), outs
    return outs


def one_process(data_dir, out_dir, *extra):
    cfg, given = hg.parse_args(flags(data_dir, out_dir, *extra))
    hg.train(cfg, given)


def weights(out_dir):
    return torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=False)['model']


def assert_close(a, b):
    # the ranks sum the same microbatch gradients in another order (each rank its share, then
    # the all-reduce), which differs from one process's sum by fp32 rounding, 1e-7 relative;
    # Adam's update is about lr * g/sqrt(v), so the weights move apart by a like fraction of
    # lr each step: over 4 to 8 steps ~1e-7 of the weights (measured 8e-8), bound 1e-5. (Elements
    # whose gradient is rounding only, like the key biases', whose exact gradient is 0, can
    # differ by more, up to lr a step: so the bound is on the whole model's norm.)
    num = sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
    assert num <= 1e-5 * sum((a[k] ** 2).sum() for k in a) ** 0.5


@pytest.mark.slow  # two torchrun launches: test_mean_is_over_the_microbatches_used_on_every_rank is the fast one
def test_two_ranks_match_one_process_and_resume_across_numbers_of_ranks(data_dir, tmp_path):
    one_process(data_dir, tmp_path / 'one', '--max_iters', '8')
    straight = weights(tmp_path / 'one')
    # a: 1 process to step 4 (the straight run's checkpoint before its last: the rate is constant), then 2 ranks
    shutil.copytree(tmp_path / 'one', tmp_path / 'a')
    os.replace(tmp_path / 'a' / 'ckpt.prev.pt', tmp_path / 'a' / 'ckpt.pt')
    assert torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=True)['iter_num'] == 4
    (out, _, _), (out1, _, _) = two_ranks(data_dir, tmp_path / 'b', '--max_iters', '4')  # b: 2 ranks, then 1
    assert_close(weights(tmp_path / 'b'), weights(tmp_path / 'a'))
    # only rank 0 writes: its files, each row once; and its rows hold every rank's split and speeds
    assert sorted(os.listdir(tmp_path / 'b')) == ['best.pt', 'ckpt.pt', 'metrics.jsonl']
    rows = [json.loads(l) for l in open(tmp_path / 'b' / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == [2, 4] and out.count('parameters, mode') == 1 and out1 == ''
    for r in rows:
        assert [x['ane_microbatches'] for x in r['ranks']] == [1, 1] and r['ranks'][1]['gpu_tokens_per_s'] > 0
        assert r['ranks'][0]['gpu_loss'] != r['ranks'][1]['gpu_loss']  # shares of their own, not copies
        assert r['tokens'] == r['step'] * 4 * 2 * 16  # every rank's tokens
    two_ranks(data_dir, tmp_path / 'a', '--max_iters', '8', '--resume')
    one_process(data_dir, tmp_path / 'b', '--max_iters', '8', '--resume')
    for run in 'ab':
        assert_close(weights(tmp_path / run), straight)


@pytest.mark.slow  # (two more processes)
def test_init_from_under_ranks_gives_every_rank_the_pretrained_weights(data_dir, tmp_path):
    # rank 0 alone reads the Hugging Face folder; the other rank gets its weights from rank 0, not
    # its own random start: two ranks train as one process does from the same folder (weights
    # after 4 steps within assert_close's bound), and rank 0's rows log the same losses
    import transformers
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=16))
    hf.save_pretrained(tmp_path / 'hf')
    init = ('--init_from', str(tmp_path / 'hf'), '--max_iters', '4')
    one_process(data_dir, tmp_path / 'one', *init)
    two_ranks(data_dir, tmp_path / 'two', *init)
    assert_close(weights(tmp_path / 'two'), weights(tmp_path / 'one'))
    rows = {run: [json.loads(line)['loss'] for line in open(tmp_path / run / 'metrics.jsonl')] for run in ('one', 'two')}
    assert rows['one'] == pytest.approx(rows['two'], rel=1e-5), rows  # (fp32 sums in another order: 1e-7)


# ---- two ranks on gloo, spawned once: the mean over them (engines the test controls), and the
# trainer's loop, whose same-weights check stops ranks that part

def value_grads(model):  # a microbatch's gradient is the value in its tokens; inf marks an overflow
    return lambda idx: {k: torch.full_like(p, float(idx[0, 0])) for k, p in model.named_parameters()}


def mbs(values):
    return [(torch.full((1, 8), v, dtype=torch.float64), torch.zeros(1, 8, dtype=torch.long)) for v in values]


class Step(hg.HeteroStep):
    def check(self, microbatches):  # these microbatches carry gradient values, not token ids
        pass


def cross_rank_checks(rank, data_dir, out_dir):
    """The mean over the ranks' usable microbatches, and ranks whose weights part named by the check."""
    model, ref = tiny_model(), tiny_model()
    # (ane values, gpu values) per rank; the ANE takes the first half of each rank's share
    for case, expect in (([(float('inf'),) * 2 + (3, 4), (5, 6, 7, 8)], [3, 4, 5, 6, 7, 8]),
                         ([(float('inf'),) * 4, (5, 6, 7, 8)], [5, 6, 7, 8]),
                         ([(float('inf'),) * 4, (float('inf'),) * 4], [])):
        eng = {'gpu': FakeEngine('gpu', 0, value_grads(model)), 'ane': FakeEngine('ane', 0, value_grads(model))}
        step = Step(model, eng, hg.Split(4, 0.5), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        out = step(mbs(case[rank]))
        assert out.n == len(expect), (rank, case)  # the global count, on every rank
        if expect:
            # the same arithmetic in one process: one engine over the microbatches used anywhere
            one = Step(ref, {'gpu': FakeEngine('gpu', 0, value_grads(ref))}, hg.Split(len(expect), 0))
            with pytest.MonkeyPatch.context() as m:  # (in this process alone: no all-reduce)
                m.setattr(dist, 'is_initialized', lambda: False)
                assert one(mbs(expect)).loss == out.loss == 2.0
            for g, r in zip(model.parameters(), ref.parameters()):
                assert torch.equal(g.grad, r.grad)  # small integers: exact in fp32
                assert torch.equal(g.grad, torch.full_like(g, sum(expect) / len(expect)))
        else:
            assert step.skipped == 1 and all(p.grad is None for p in model.parameters())
        step.update(out)  # every rank steps (rank 0 too, with nothing of its own), or none does
        distributed.check_same_weights(model, 1)
    if rank == 1:  # weights that part are named on every rank
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    with pytest.raises(RuntimeError, match=r'weights of ranks \[1\] differ'):
        distributed.check_same_weights(model, 2)


def parting_run(rank, data_dir, out_dir):
    """train() on this rank of 2, GPU mode, an evaluation at step 2: after the first update,
    rank 1 moves one weight element by 0.1 (5 times the weights' spread at init; the check's
    checksum, ~1e3 here, is compared to 1e-6 relative). Saves the microbatches its step got."""
    seen = []

    class Parting(hg.HeteroStep):
        def __call__(self, microbatches):
            seen.append([(x.clone(), y.clone()) for x, y in microbatches])
            return super().__call__(microbatches)

        def update(self, result, grad_clip=0.0):
            out = super().update(result, grad_clip)
            if rank == 1 and len(seen) == 1:
                with torch.no_grad():
                    next(iter(self.params.values())).view(-1)[0] += 0.1
            return out
    run = os.path.join(out_dir, 'run')
    cfg, given = hg.parse_args(flags(data_dir, run, '--mode', 'gpu', '--max_iters', '4', '--eval_interval', '2'))
    with pytest.raises(RuntimeError, match=r"at step 2 the weights of ranks \[1\] differ from rank 0's"):
        hg.train(cfg, given, hg.Classes(step=Parting))
    torch.save(seen, os.path.join(out_dir, f'seen{rank}.pt'))


def rank_worker(rank, init, data_dir, out_dir):
    """Rank `rank` of 2 on gloo: each part in turn; a file marks each part done on this rank.
    A part that fails ends the process, and mp.spawn the other rank."""
    dist.init_process_group('gloo', init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=HANG))
    torch.set_num_threads(1)
    for part in (cross_rank_checks, parting_run):
        part(rank, data_dir, out_dir)
        open(os.path.join(out_dir, f'{part.__name__}{rank}.done'), 'w').close()
    dist.destroy_process_group()


@pytest.fixture(scope='module')
def gloo_ranks(data_dir, tmp_path_factory):
    """Two ranks spawned once (a start-up of seconds) for the two tests below: (folder, error)."""
    out = tmp_path_factory.mktemp('ranks')
    try:
        mp.spawn(rank_worker, args=(f'file://{out}/init', data_dir, str(out)), nprocs=2)
    except Exception as e:  # (each test then says whether its part finished)
        return out, str(e)
    return out, None


def test_mean_is_over_the_microbatches_used_on_every_rank(gloo_ranks):
    out, error = gloo_ranks
    assert all((out / f'cross_rank_checks{r}.done').exists() for r in range(2)), error


def test_the_loop_stops_ranks_whose_weights_part_and_each_draws_its_share(gloo_ranks, data_dir):
    # the loop's own check, at its evaluation of step 2, names rank 1 on both ranks; and the two
    # ranks' microbatches of steps 1 and 2 are, in rank order, the step's batches of one process
    out, error = gloo_ranks
    assert all((out / f'parting_run{r}.done').exists() for r in range(2)), error
    seen = [torch.load(out / f'seen{r}.pt') for r in range(2)]
    assert [len(s) for s in seen] == [2, 2]
    cfg, given = hg.parse_args(flags(data_dir, None))
    cfg = hg.setup(cfg, given, log=lambda s: None)[0]
    data = hg.load_data(cfg)['train']
    for it in range(2):
        whole = hg.step_batches(cfg, data, it)
        assert len(whole) == 4 and len(seen[0][it]) == len(seen[1][it]) == 2
        for (x, y), (a, b) in zip(whole, seen[0][it] + seen[1][it]):
            assert torch.equal(x, a) and torch.equal(y, b), it


# ---- faults

def rows_reach(out_dir, step, proc, limit=HANG):
    path, t0 = os.path.join(out_dir, 'metrics.jsonl'), time.time()
    while not (os.path.exists(path) and any(json.loads(l)['step'] >= step for l in open(path))):
        assert proc.poll() is None and time.time() - t0 < limit, proc.communicate()
        time.sleep(0.1)


def ckpt_intact_and_resumable(data_dir, out_dir):
    ck = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=False)
    assert ck['iter_num'] >= 4 and ck['iter_num'] % 4 == 0, ck['iter_num']
    one_process(data_dir, out_dir, '--max_iters', str(ck['iter_num'] + 2), '--resume')


@pytest.mark.slow  # (torchrun's agent and a resumed run: 10 s; the ranks' start is in the default run)
@pytest.mark.skipif(not os.path.isdir('/proc'), reason="finds the rank's process in /proc")
def test_killed_rank_is_named_by_the_others(data_dir, tmp_path):
    # under torchrun: rank 1 is killed; the agent stops rank 0 (SIGTERM), which says which rank stopped.
    # (no timeout is waited for here; 60 s lets ranks that start seconds apart on a busy machine meet)
    p = torchrun(2, data_dir, tmp_path, '--max_iters', '100000', '--dist_timeout', '60')
    rows_reach(tmp_path, 6, p)
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            cmd, env = (open(f'/proc/{pid}/{f}', 'rb').read().split(b'\0') for f in ('cmdline', 'environ'))
        except OSError:
            continue
        if str(tmp_path).encode() in cmd and b'RANK=1' in env and b'hetero_gpt.py' in b' '.join(cmd):
            os.kill(int(pid), signal.SIGKILL)
    _, err = p.communicate(timeout=HANG)
    assert p.returncode != 0
    assert 'error: rank 0: ranks [1] stopped' in err, err
    ckpt_intact_and_resumable(data_dir, tmp_path)


@pytest.mark.slow  # (a timeout of 5 s by design, and two ranks' start: in CI's slow run)
def test_hung_rank_is_named_after_the_timeout(data_dir, tmp_path):
    # rank 1 stopped (SIGSTOP): rank 0's next collective times out after --dist_timeout, and names it.
    # (5 s: the ranks' start also waits for each other that long, and they may start seconds apart)
    procs = ranks(2, data_dir, tmp_path, '--max_iters', '100000', '--dist_timeout', '5')
    try:
        rows_reach(tmp_path, 6, procs[0])
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=HANG)
        assert procs[0].returncode == 1 and 'error: rank 0: ranks [1] stopped' in err, err
        assert 'Timed out' in err and time.time() - t0 >= 5
    finally:
        procs[1].kill()
        procs[1].communicate()
    ckpt_intact_and_resumable(data_dir, tmp_path)


# ---- leaving the group: at Ctrl-C too, never while an error goes up to be named

def rank0_alone(data_dir, out_dir, patch):
    """hg.main as rank 0 of 1, as torchrun starts it, in a process of its own after `patch` (Python):
    (its exit code, its stderr, whether it was still in the group as main returned)."""
    script = (f"import os, sys; sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]\n"
              "import torch.distributed as dist, hetero_gpt as hg, helpers\n" + patch + "\n"
              "try:\n    hg.main(helpers.flags(*sys.argv[1:], max_iters=2))\n    code = 0\n"
              "except SystemExit as e:\n    code = e.code\n"
              "print('joined', dist.is_initialized(), file=sys.stderr, flush=True)\n"
              "os._exit(code)  # (as the run ends: no process-wide teardown to wait for)\n")
    env = dict(os.environ, OMP_NUM_THREADS='1', RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',
               MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, '-c', script, data_dir, str(out_dir)], cwd=ROOT, env=env, text=True,
                       capture_output=True, timeout=HANG)
    return p.returncode, p.stderr, p.stderr.strip().splitlines()[-1] == 'joined True'


@pytest.mark.slow  # (a process of its own: seconds of start-up)
def test_ctrl_c_leaves_the_group_with_exit_code_130_and_its_checkpoint(data_dir, tmp_path):
    # Ctrl-C between steps (as conftest's ctrl_c): exit code 130, the checkpoint of step 1, and
    # the group left, as at a run's end
    code, err, joined = rank0_alone(data_dir, tmp_path, "real = hg.step_batches\n"
                                    "def batches(cfg, data, it):\n"
                                    "    if it == 1:\n        raise KeyboardInterrupt\n"
                                    "    return real(cfg, data, it)\n"
                                    "hg.step_batches = batches")
    assert code == 130 and not joined, err
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 1


@pytest.mark.slow  # (the stopped ranks are those whose heartbeat stands still for 3 s)
def test_an_error_keeps_the_group_that_names_the_stopped_ranks(data_dir, tmp_path):
    # a failed collective goes up through train's finally: the group stays, so main names the
    # ranks that stopped (none here: the line is the error's), in one line with exit code 1
    code, err, joined = rank0_alone(data_dir, tmp_path, "def fail(self, microbatches):\n"
                                    "    raise RuntimeError('a collective failed')\n"
                                    "hg.HeteroStep.__call__ = fail")
    assert code == 1 and joined, err
    assert err.strip().splitlines()[-2] == "error: rank 0: a collective failed" and 'Traceback' not in err, err
