"""Containment, tried as a hostile participant would: each attack is a train.py (or inference.py)
driven through the command line (the harness in its own process wherever the attack reaches for it:
its command line, environment, memory, output, files or children; in this process where what is
tried is the worker's own reach, its replies or its caps), and each is refused with a clear message
or gains nothing.
Where an attack works without the sandbox, a control run with --no-sandbox shows that it does,
so the test can fail. An honest model gets the same number contained, uncontained and in process."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core_bundle import make_bundle
from helpers import REPO, can_drop_kernel_caches, make_text_source, random_documents, run_prepare
from hostile import SEQ, TOKENS, evaluate, participant
from harness.worker import sandbox
from harness.worker.harness_side import MAX_FORWARDED_BYTES

pytestmark = [  # every test here runs the contained evaluation end to end: all of them are slow
    pytest.mark.slow,
    pytest.mark.skipif(sandbox.sandbox_shortfall() != "", reason=f"no full sandbox on this machine: "
                                                                f"{sandbox.sandbox_shortfall()}"),
]


def result_lines(stdout: str) -> dict:
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in stdout.splitlines()
                                              if ":" in line and not line.startswith("["))}


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def val_shard(text_dataset):
    return str(next(p for p in sorted(text_dataset.glob("shard_*.parquet"))
                    if p.name in json.loads((text_dataset / "manifest.json").read_text())["splits"]["public_val"]))


def score_shard(train_py, checkpoint, dataset, shard, *extra):
    """`prepare.py eval --val-shard shard`: the shard's path is on the harness's command line."""
    return evaluate(train_py, checkpoint, dataset, *extra, command=["eval", "--val-shard", shard])


@pytest.fixture(scope="module")
def honest_runs(tmp_path_factory, checkpoint, text_dataset, val_shard, honest):
    """The honest bigram's result lines: eval-public, and eval of the validation shard by path."""
    result, lines = score_shard(participant(tmp_path_factory.mktemp("honest"), "train"), checkpoint, text_dataset,
                                val_shard)
    assert result.returncode == 0, result.stderr
    return {"public": honest, "shard": lines}


def assert_refused(result, lines, message):
    assert result.returncode == 1, (result.stdout, result.stderr[-3000:])
    assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("[worker]")[0] and "val_bpb" not in lines


# --- 1. reading the data ------------------------------------------------------------------------

READ_THE_DATA = '''
import glob
import os
import sys

import pyarrow.parquet as pq

PARENT = os.getppid()


def candidate_shards():
    """The scored shard's path from the harness's command line, and its data folder from its environment."""
    found = []
    argv = open(f"/proc/{PARENT}/cmdline", "rb").read().split(b"\\0")
    found += [a.decode() for a in argv if a.endswith(b".parquet")]
    try:
        env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{PARENT}/environ", "rb").read().split(b"\\0") if b"=" in kv)
        found += sorted(glob.glob(os.path.join(env.get(b"FRONTIER_DATA_DIR", b"").decode(), "shard_*.parquet")))
    except OSError as e:
        print("ENVIRON", type(e).__name__, file=sys.stderr)
    return found


TABLE = {}
for path in candidate_shards():
    try:
        texts = pq.read_table(path).column("text").to_pylist()
    except Exception as e:
        print("DATA DENIED", type(e).__name__, file=sys.stderr)
        continue
    print("DATA READ", path, file=sys.stderr)
    from prepare import ensure_tokenizer
    tok = ensure_tokenizer()
    for ids in tok.encode(texts, prepend=tok.get_bos_token_id()):
        for t in range(8, len(ids)):
            TABLE[tuple(ids[t - 8:t])] = ids[t]


class Cheat(Model):
    """Strictly causal: position t looks up tokens t-7..t in a table of the validation text."""

    def forward(self, idx):
        logits = self.honest(idx)
        for b, row in enumerate(idx.tolist()):
            for t in range(7, len(row)):
                nxt = TABLE.get(tuple(row[t - 7:t + 1]))
                if nxt is not None:
                    logits[b, t, nxt] += 30.0
        return logits
'''


def test_reading_the_scored_data_gains_nothing(tmp_path, checkpoint, text_dataset, val_shard, honest_runs):
    cheat = participant(tmp_path, "read_the_data", READ_THE_DATA)
    control, control_lines = score_shard(cheat, checkpoint, text_dataset, val_shard, "--no-sandbox")
    assert control.returncode == 0, control.stderr[-3000:]
    assert "[worker] DATA READ" in control.stderr  # without the sandbox the attack works ...
    assert float(control_lines["val_bpb"]) < 0.5 * float(honest_runs["shard"]["val_bpb"])
    assert control_lines["official"].startswith("False") and "--no-sandbox" in control_lines["official"]
    result, lines = score_shard(cheat, checkpoint, text_dataset, val_shard)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DATA READ" not in result.stderr and "[worker] DATA DENIED PermissionError" in result.stderr
    assert "[worker] ENVIRON PermissionError" in result.stderr
    assert lines["val_bpb"] == honest_runs["shard"]["val_bpb"]  # ... and in it, it gains nothing


# --- 2, 3. the harness's memory -----------------------------------------------------------------

HARNESS_MEMORY = '''
import os
import sys

for mode in ("rb", "r+b"):
    try:
        with open(f"/proc/{os.getppid()}/mem", mode) as mem:
            start = int(open(f"/proc/{os.getppid()}/maps").readline().split("-")[0], 16)
            mem.seek(start)
            mem.read(16)
        print("MEM", mode, "OPEN", file=sys.stderr)
    except OSError as e:
        print("MEM", mode, "DENIED", type(e).__name__, file=sys.stderr)


class Cheat(Model):
    pass
'''


def test_the_harness_memory_is_out_of_reach(tmp_path, checkpoint, text_dataset, honest_runs):
    cheat = participant(tmp_path, "memory", HARNESS_MEMORY)
    if os.geteuid() == 0:  # root can open another process's memory, unless the sandbox stops it
        control, _ = evaluate(cheat, checkpoint, text_dataset, "--no-sandbox")
        assert "[worker] MEM rb OPEN" in control.stderr and "[worker] MEM r+b OPEN" in control.stderr
    result, lines = evaluate(cheat, checkpoint, text_dataset)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[worker] MEM rb DENIED PermissionError" in result.stderr
    assert "[worker] MEM r+b DENIED PermissionError" in result.stderr
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]


# --- 4. a daemon that outlives the run ----------------------------------------------------------

DAEMON = '''
import json
import os
import sys
import time

PARENT = os.getppid()
argv = open(f"/proc/{PARENT}/cmdline", "rb").read().split(b"\\0")
REPORT = argv[argv.index(b"--report") + 1].decode()
child = os.fork()
if child == 0:
    try:
        os.setsid()
    except OSError as e:
        print("DAEMON SETSID", type(e).__name__, file=sys.stderr, flush=True)
    if os.fork() == 0:
        print("DAEMON PID", os.getpid(), file=sys.stderr, flush=True)
        try:
            out = open(f"/proc/{PARENT}/fd/1", "w")
        except OSError as e:
            out = None
            print("DAEMON STDOUT", type(e).__name__, file=sys.stderr, flush=True)
        while not os.path.exists(REPORT):
            time.sleep(0.02)
        time.sleep(0.3)
        if out is not None:
            out.write("val_bpb:                 0.010000\\nofficial:                True\\n")
            out.flush()
        try:
            with open(REPORT, "w") as f:
                json.dump({"val_bpb": 0.01, "official": True}, f)
        except OSError as e:
            print("DAEMON REPORT", type(e).__name__, file=sys.stderr, flush=True)
        time.sleep(60)
    os._exit(0)
os.waitpid(child, 0)


class Cheat(Model):
    pass
'''


def test_a_detached_daemon_is_dead_before_the_result(tmp_path, checkpoint, text_dataset, honest_runs):
    report = tmp_path / "report.json"
    result, lines = evaluate(participant(tmp_path, "daemon", DAEMON), checkpoint, text_dataset, "--report", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    pid = int(next(line.split()[-1] for line in result.stderr.splitlines() if line.startswith("[worker] DAEMON PID ")))
    assert "[worker] DAEMON STDOUT PermissionError" in result.stderr
    time.sleep(1.0)
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped before the harness printed
    assert result.stdout.count("val_bpb") == 1 and lines["val_bpb"] == honest_runs["public"]["val_bpb"]
    assert f'{json.loads(report.read_text())["val_bpb"]:.6f}' == honest_runs["public"]["val_bpb"]


HOPPER = '''
import ctypes
import os
import sys
import time


def hoppers():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/comm").read().strip() == "frontier-hopper":
                found.append(pid)
        except OSError:
            pass
    return found


print("HOPPER", "SEEN" if hoppers() else "GONE", file=sys.stderr, flush=True)
if os.fork() == 0:  # a daemon that leaves the session, then changes its pid all the time
    try:
        os.setsid()
    except OSError as e:
        print("SETSID", type(e).__name__, file=sys.stderr, flush=True)
    ctypes.CDLL(None).prctl(15, b"frontier-hopper")
    end = time.time() + 60
    while time.time() < end:
        if os.fork():
            os._exit(0)
        time.sleep(0.005)
    os._exit(0)


class Cheat(Model):
    pass
'''


def running_hoppers() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "frontier-hopper":
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_daemon_that_keeps_changing_its_pid_dies_with_its_worker(tmp_path, checkpoint, text_dataset, honest_runs):
    """It could carry what the first worker saw to the second: the second must never see it."""
    result, lines = evaluate(participant(tmp_path, "hopper", HOPPER), checkpoint, text_dataset)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[worker] HOPPER GONE" in result.stderr and "[worker.2] HOPPER GONE" in result.stderr
    assert "[worker] SETSID PermissionError" in result.stderr and "HOPPER SEEN" not in result.stderr
    assert running_hoppers() == [] and lines["val_bpb"] == honest_runs["public"]["val_bpb"]


# --- 5, 11. values and messages from the worker ------------------------------------------------

FORGED_REPLY = '''
import struct

import harness.worker.wire as P

_send = P.send


def send(sock, header, payload=b"", fds=()):
    if "device" in header:  # the reply to "load"
        {forge}
    return _send(sock, header, payload, fds)


P.send = send


class Cheat(Model):
    pass
'''

FORGERIES = {
    "device": ('header = dict(header, device="cpu\\n---\\nval_bpb:                 0.010000\\nofficial: True")',
               "reported a device that is not a device name"),
    "infinity": ('data = b\'{{"payload": Infinity}}\'\n        return sock.sendall(struct.pack("<I", len(data)) + data)',
                 "malformed message header"),
    "huge_header": ('data = b" " * (1 << 20)\n        return sock.sendall(struct.pack("<I", len(data)) + data)',
                    "message header (at most"),
    "not_an_object": ('data = b"[1, 2]"\n        return sock.sendall(struct.pack("<I", len(data)) + data)',
                      "not a JSON object"),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_reply_is_one_clear_error(tmp_path, checkpoint, text_dataset, forgery):
    code, message = FORGERIES[forgery]
    result, lines = evaluate(participant(tmp_path, forgery, FORGED_REPLY.format(forge=code)), checkpoint, text_dataset,
                             own_process=False)
    assert_refused(result, lines, message)
    assert "0.010000" not in result.stdout and "Traceback" not in result.stderr


# --- 6, 7. the files on disk --------------------------------------------------------------------

SWAP_FILES = '''
import os
import sys

argv = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
TRAIN_PY, CHECKPOINT = (argv[argv.index(flag) + 1].decode() for flag in (b"--train-py", b"--checkpoint"))


def swap():
    for what, action in (("TRAIN_PY", lambda: open(TRAIN_PY, "a").write("# not what ran")),
                         ("CHECKPOINT", lambda: open(CHECKPOINT, "r+b").write(b"not the weights")),
                         ("FIFO", lambda: (os.mkfifo("fifo"), os.rename("fifo", CHECKPOINT)))):
        try:
            action()
            print("SWAPPED", what, file=sys.stderr)
        except OSError as e:
            print("SWAP", what, type(e).__name__, file=sys.stderr)


class Cheat(Model):
    def __init__(self):
        super().__init__()
        swap()
'''


def test_files_swapped_after_loading_change_nothing(tmp_path, checkpoint, text_dataset, honest_runs):
    import shutil
    ckpt = tmp_path / "final.pt"
    shutil.copyfile(checkpoint, ckpt)
    cheat = participant(tmp_path, "swap", SWAP_FILES)
    before = {"train_py": sha256(cheat), "checkpoint": sha256(ckpt)}
    t0 = time.time()
    result, lines = evaluate(cheat, str(ckpt), text_dataset)
    assert result.returncode == 0, result.stderr[-3000:]
    for what in ("TRAIN_PY", "CHECKPOINT"):
        assert f"[worker] SWAP {what} PermissionError" in result.stderr, result.stderr[-2000:]
    # a private folder of its own filesystem (the kernel's disk cap) makes the rename EXDEV before Landlock says no
    assert re.search(r"\[worker\] SWAP FIFO (PermissionError|OSError)", result.stderr), result.stderr[-2000:]
    assert "SWAPPED" not in result.stderr
    assert lines["train_py_sha256"] == before["train_py"] == sha256(cheat)
    assert lines["checkpoint_sha256"] == before["checkpoint"] == sha256(ckpt)
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"] and time.time() - t0 < 120
    control, control_lines = evaluate(cheat, str(ckpt), text_dataset, "--no-sandbox")
    assert control.returncode == 0 and "[worker] SWAPPED TRAIN_PY" in control.stderr  # the files did change ...
    assert control_lines["train_py_sha256"] == before["train_py"]  # ... but the printed hashes are of what ran
    assert control_lines["checkpoint_sha256"] == before["checkpoint"]


def test_special_files_are_refused_before_anything_runs(tmp_path, checkpoint, text_dataset):
    fifo = tmp_path / "final.pt"
    os.mkfifo(fifo)
    link = tmp_path / "link.py"
    link.symlink_to(participant(tmp_path, "train"))
    kit = tmp_path / "kit"
    (kit / "kernels").mkdir(parents=True)
    (kit / "train.py").write_text(Path(participant(tmp_path, "train")).read_text())
    (kit / "kernels" / "leak.py").symlink_to(Path(text_dataset) / "manifest.json")
    cases = [([participant(tmp_path, "train"), str(fifo)], "is not a regular file"),
             ([str(link), checkpoint], "is a symbolic link"),
             ([str(kit / "train.py"), checkpoint], "is a symbolic link")]
    for (train_py, ckpt), message in cases:
        t0 = time.time()
        result, lines = evaluate(train_py, ckpt, text_dataset, own_process=False)
        assert_refused(result, lines, message)
        assert time.time() - t0 < 60


def test_the_kernels_folder_is_copied_and_hashed(tmp_path, checkpoint, text_dataset, honest_runs):
    kit = tmp_path / "kit"
    (kit / "kernels").mkdir(parents=True)
    (kit / "kernels" / "__init__.py").write_text("SCALE = 1.0\n")
    (kit / "train.py").write_text(Path(participant(tmp_path, "train")).read_text().replace(
        "class Model(nn.Module):", "from kernels import SCALE\n\n\nclass Model(nn.Module):"))
    result, lines = evaluate(str(kit / "train.py"), checkpoint, text_dataset, own_process=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(lines["kernels_sha256"]) == 64 and lines["val_bpb"] == honest_runs["public"]["val_bpb"]


# --- 8. requests that are never answered --------------------------------------------------------

# A worker that stalls in its model's forward, end to end. Every read the harness makes from a
# worker (the buffers' set-up, a forward, the load) goes through wire.recv with the run's deadline,
# which tests/test_wire.py holds against a worker that sends nothing, part of a frame, or a drip.
NEVER_ANSWERS = {
    "forward": '''
import sys
import time


class Cheat(Model):
    def forward(self, idx):
        print("STALLING", file=sys.stderr, flush=True)
        time.sleep(10**6)
''',
}


@pytest.mark.parametrize("where", sorted(NEVER_ANSWERS))
def test_a_worker_that_never_answers_meets_the_deadline(tmp_path, checkpoint, text_dataset, where):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    t0 = time.time()
    result, lines = evaluate(participant(tmp_path, where, NEVER_ANSWERS[where]), checkpoint, text_dataset,
                             "--timeout", "8", env={"TMPDIR": str(scratch)})  # 4x the 2 s to the stall, alone
    assert_refused(result, lines, "did not finish within 8s (--timeout)")
    assert "STALLING" in result.stderr  # the deadline met the stall, not a slow start
    assert time.time() - t0 < 8 + 30
    assert list(scratch.iterdir()) == []  # the worker's and the submission's folders are gone


# --- 9. the shared logits buffers ---------------------------------------------------------------

SHRINK_THE_BUFFER = '''
import gc
import mmap
import os
import sys


class Cheat(Model):
    tried = False

    def forward(self, idx):
        if not Cheat.tried:
            Cheat.tried = True
            for m in [o for o in gc.get_objects() if isinstance(o, mmap.mmap)]:
                try:
                    m.resize(4096)
                    print("RESIZED", file=sys.stderr)
                except OSError as e:
                    print("RESIZE", type(e).__name__, file=sys.stderr)
            for name in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:frontier-logits"):
                        os.ftruncate(int(name), 0)
                        print("TRUNCATED", file=sys.stderr)
                except OSError as e:
                    print("TRUNCATE", type(e).__name__, file=sys.stderr)
        return self.honest(idx)
'''


def test_the_logits_buffers_cannot_shrink(tmp_path, checkpoint, text_dataset, honest_runs):
    result, lines = evaluate(participant(tmp_path, "shrink", SHRINK_THE_BUFFER), checkpoint, text_dataset,
                             own_process=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[worker] RESIZE PermissionError" in result.stderr and "[worker] TRUNCATE PermissionError" in result.stderr
    assert "RESIZED" not in result.stderr and "TRUNCATED" not in result.stderr
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]


# --- 10. floods -----------------------------------------------------------------------------------

FLOODS = {
    "payload": '''
import struct

import harness.worker.wire as P

_send = P.send


def send(sock, header, payload=b"", fds=()):
    if "device" in header:  # the reply to "load" announces 2 GiB, then sends them
        data = P.json.dumps({**header, "payload": 2**31}).encode()
        sock.sendall(struct.pack("<I", len(data)) + data)
        chunk = bytes(1 << 20)
        for _ in range(2048):
            sock.sendall(chunk)
        return None
    return _send(sock, header, payload, fds)


P.send = send


class Cheat(Model):
    pass
''',
    # 250 MB in lines of 25 MB from each worker: more than the harness's peak may grow by (150 MB), so a
    # harness that kept it would show
    "stderr": '''
import sys

for _ in range(10):
    sys.stderr.write("x" * 25_000_000 + "\\n")
sys.stderr.flush()


class Cheat(Model):
    pass
''',
}


def peak_rss_run(args, dataset):
    """prepare.py with args in a process that reports its own peak RSS (MB) on its last stderr line."""
    code = ("import resource, runpy, sys\nsys.argv = ['prepare.py'] + sys.argv[1:]\ntry:\n"
            "    runpy.run_path('prepare.py', run_name='__main__')\nfinally:\n"
            "    print('PEAK_RSS_MB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr)\n")
    import subprocess
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, FRONTIER_DATA_DIR=str(dataset)))
    return result, int(result.stderr.rsplit("PEAK_RSS_MB", 1)[1].split()[0])


def eval_args(checkpoint) -> list[str]:
    return ["eval-public", "--checkpoint", checkpoint, "--device", "cpu", "--seq-len", str(SEQ), "--max-tokens",
            str(TOKENS)]


@pytest.fixture(scope="module")
def honest_peak_rss(tmp_path_factory, checkpoint, text_dataset) -> int:
    """The harness's peak RSS (MB) scoring the honest bigram."""
    train_py = participant(tmp_path_factory.mktemp("honest_rss"), "train")
    return peak_rss_run(eval_args(checkpoint) + ["--train-py", train_py], text_dataset)[1]


@pytest.mark.slow
@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_a_flood_leaves_the_harness_memory_alone(tmp_path, checkpoint, text_dataset, honest_runs, honest_peak_rss,
                                                  flood):
    baseline = honest_peak_rss
    result, peak = peak_rss_run(eval_args(checkpoint) + ["--train-py", participant(tmp_path, flood, FLOODS[flood])],
                                text_dataset)
    assert peak < baseline + 150, (peak, baseline)
    assert len(result.stderr) < 2 * MAX_FORWARDED_BYTES + (1 << 20)  # each of the two workers: at most its cap
    if flood == "payload":
        assert result.returncode == 1 and "announced a payload of '2147483648' bytes" in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "MiB of output; the rest is not shown" in result.stderr
        assert result_lines(result.stdout)["val_bpb"] == honest_runs["public"]["val_bpb"]


# --- 12. the data on disk ----------------------------------------------------------------------------

def test_a_replaced_validation_shard_is_refused_and_setup_repairs_it(tmp_path, checkpoint):
    source = make_text_source(tmp_path / "source", random_documents(300, seed=5))
    cache = tmp_path / "cache"
    env = {"FRONTIER_CACHE_DIR": str(cache)}
    assert run_prepare(["setup", "--source", f"dir:{source}", "--tokenizer", "stdlib"], env).returncode == 0
    dataset = Path(json.loads((cache / "active.json").read_text())["dataset_dir"])
    manifest = json.loads((dataset / "manifest.json").read_text())
    val = dataset / manifest["splits"]["public_val"][0]
    original = val.read_bytes()
    train_py = participant(tmp_path, "train")
    args = ["eval-public", "--train-py", train_py, "--checkpoint", checkpoint, "--device", "cpu", "--seq-len",
            str(SEQ), "--max-tokens", str(SEQ * 16)]
    before = run_prepare(args, env)
    assert before.returncode == 0, before.stderr[-2000:]
    assert result_lines(before.stdout)["shard_sha256"] == manifest["sha256"][val.name] == sha256(val)
    pq.write_table(pa.table({"text": random_documents(50, seed=99)}), val)  # other valid parquet
    refused = run_prepare(args, env)
    assert refused.returncode == 1 and "but it is pinned as" in refused.stderr and "val_bpb" not in refused.stdout
    again = run_prepare(["setup", "--source", f"dir:{source}", "--tokenizer", "stdlib"], env)
    assert again.returncode == 0 and "rebuilding" in again.stdout
    assert val.read_bytes() == original
    after = run_prepare(args, env)
    assert result_lines(after.stdout)["val_bpb"] == result_lines(before.stdout)["val_bpb"]


# --- the sandbox itself ------------------------------------------------------------------------------

PROBE = '''
import ctypes
import os
import socket
import sys

PARENT = os.getppid()
SECRET, LISTENING = os.environ["SUBMISSION_PROBE_SECRET"], int(os.environ["SUBMISSION_PROBE_PORT"])
KIT_FILE = os.environ["SUBMISSION_PROBE_KIT"]  # a file of the kit the harness runs from (the worker has a copy)


def attempt(name, action):
    try:
        action()
        print("PROBE", name, "ALLOWED", file=sys.stderr)
    except OSError as e:
        print("PROBE", name, "DENIED", type(e).__name__, file=sys.stderr)


def libc_call(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) == -1:
        raise OSError(ctypes.get_errno(), name)


attempt("read_file", lambda: open(SECRET).read())
attempt("read_via_proc_root", lambda: open(f"/proc/self/root{SECRET}").read())
attempt("list_tmp", lambda: os.listdir("/tmp"))
attempt("parent_environ", lambda: open(f"/proc/{PARENT}/environ", "rb").read())
attempt("tcp_connect", lambda: socket.create_connection(("127.0.0.1", LISTENING), timeout=5))
# The control run has no sandbox: it stops here, before anything that would change the machine.
if os.environ.get("SUBMISSION_PROBE_CONTROL") != "1":
    attempt("write_tmp", lambda: open("/tmp/frontier-probe", "w").write("x"))
    attempt("write_dev_shm", lambda: open("/dev/shm/frontier-probe", "w").write("x"))
    attempt("write_kit", lambda: open(KIT_FILE, "a").write("x"))
    attempt("parent_fd", lambda: open(f"/proc/{PARENT}/fd/1", "w"))
    attempt("parent_cwd", lambda: os.listdir(f"/proc/{PARENT}/cwd"))
    attempt("tcp_bind", lambda: socket.socket().bind(("127.0.0.1", 0)))
    attempt("unix_socket", lambda: socket.socket(socket.AF_UNIX))
    attempt("unix_datagram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))  # syslog's /dev/log
    attempt("write_proc_sys", lambda: os.close(os.open("/proc/sys/kernel/domainname", os.O_WRONLY)))  # opened only
    attempt("write_sys", lambda: os.close(os.open("/sys/devices/system/cpu/cpu0/online"
                                                  if os.path.exists("/sys/devices/system/cpu/cpu0/online")
                                                  else "/sys/devices/system/cpu/uevent", os.O_WRONLY)))
    attempt("write_var_tmp", lambda: open("/var/tmp/frontier-probe", "w").write("x"))  # a compiler's shared cache
    attempt("list_sys_kernel", lambda: os.listdir("/sys/kernel"))
    attempt("list_usr_share", lambda: os.listdir("/usr/share"))
    attempt("netlink_socket", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
    attempt("signal_parent", lambda: os.kill(PARENT, 0))
    attempt("sysv_shm", lambda: libc_call("shmget", 4242, 4096, 0o1666))
    attempt("sysv_msg", lambda: libc_call("msgget", 4242, 0o1666))
    attempt("posix_mq", lambda: libc_call("mq_open", b"/frontier-probe", os.O_CREAT | os.O_RDWR, 0o666, None))
    attempt("keyring", lambda: libc_call("syscall", 248 if os.uname().machine == "x86_64" else 217, b"user", b"k", b"v",
                                         1, -4))
    attempt("xattr", lambda: os.setxattr("tokenizer.json", "user.frontier", b"1"))
    attempt("hostname", lambda: socket.sethostname(socket.gethostname()))  # a no-op, if it were allowed
    attempt("udp_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    attempt("mptcp_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262))
    attempt("io_uring", lambda: libc_call("syscall", 425, 8, ctypes.create_string_buffer(120)))
    attempt("setsid", lambda: os.setsid())
    attempt("unshare", lambda: libc_call("unshare", 0x10000000))  # CLONE_NEWUSER
    attempt("read_etc_shadow", lambda: open("/etc/shadow").read())
    import fcntl
    attempt("inode_flags", lambda: fcntl.ioctl(open("own.txt", "w"), 0x40086602, b"\\0" * 8))
    print("PROBE env", "SEEN" if os.environ.get("AWS_SECRET_ACCESS_KEY") else "HIDDEN", file=sys.stderr)
    import resource
    attempt("prlimit_parent", lambda: resource.prlimit(PARENT, resource.RLIMIT_NOFILE))

    def clone_new_user():
        child = ctypes.CDLL(None, use_errno=True).syscall(56 if os.uname().machine == "x86_64" else 220,
                                                          0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
        if child == 0:
            os._exit(0)
        if child < 0:
            raise OSError(ctypes.get_errno(), "clone")
        os.waitpid(child, 0)

    attempt("clone_new_namespace", clone_new_user)
    attempt("bind_abstract", lambda: socket.socketpair()[0].bind(b"\\0frontier-probe"))
    import mmap
    mapped = mmap.mmap(-1, 4096)  # page-aligned: mincore would answer for it
    attempt("mincore", lambda: libc_call("mincore", ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(mapped))),
                                         4096, ctypes.create_string_buffer(1)))
    attempt("preadv2_nowait", lambda: os.preadv(os.open(KIT_FILE, os.O_RDONLY), [bytearray(16)], 0, os.RWF_NOWAIT))
    before = os.stat(KIT_FILE)
    os.utime(KIT_FILE, (1, 1))
    os.chmod(KIT_FILE, 0o777)
    after = os.stat(KIT_FILE)
    print("PROBE metadata", "UNCHANGED" if (before.st_mtime_ns, before.st_mode) == (after.st_mtime_ns, after.st_mode)
          else "CHANGED", file=sys.stderr)
    def own_cgroups():
        """The worker's own cgroup folders: v1's memory and pids, or v2's (""), through mountinfo."""
        mounts, out = {}, {}
        for line in open("/proc/self/mountinfo"):
            pre, post = line.split(" - ")
            root, point, (fstype, _, options) = pre.split()[3], pre.split()[4], post.split()[:3]
            for c in ([""] if fstype == "cgroup2" else [c for c in options.split(",") if c in ("memory", "pids")]
                      if fstype == "cgroup" else []):
                mounts[c] = (root, point)
        for line in open("/proc/self/cgroup"):
            _, controllers, path = line.rstrip("\\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                if c in mounts and (path + "/").startswith(mounts[c][0].rstrip("/") + "/"):
                    out[c] = os.path.join(mounts[c][1], os.path.relpath(path, mounts[c][0]))
        return out

    def cgroup_attempt(name, path, action):
        if not os.path.exists(path):
            print("PROBE", name, "MISSING", path, file=sys.stderr)
        else:
            attempt(name, action)

    own = own_cgroups()
    memory, pids = (own["memory"], own.get("pids", own["memory"])) if "memory" in own else (own[""], own[""])
    limit = os.path.join(memory, "memory.limit_in_bytes" if "memory" in own else "memory.max")
    cgroup_attempt("cgroup_raise_memory", limit, lambda: open(limit, "w").write("-1" if "memory" in own else "max"))
    cgroup_attempt("cgroup_raise_pids", os.path.join(pids, "pids.max"),
                   lambda: open(os.path.join(pids, "pids.max"), "w").write("max"))
    leave = os.path.join(os.path.dirname(memory), "cgroup.procs")
    cgroup_attempt("cgroup_leave", leave, lambda: open(leave, "w").write(str(os.getpid())))
    cgroup_attempt("cgroup_child", memory, lambda: os.mkdir(os.path.join(memory, "unlimited")))
    print("PROBE cgroup_folder", memory, file=sys.stderr)
    import threading

    def from_a_thread():  # a thread started now inherits the sandbox; one started before it would not
        attempt("thread_read_file", lambda: open(SECRET).read())
        attempt("thread_unix_socket", lambda: socket.socket(socket.AF_UNIX))

    thread = threading.Thread(target=from_a_thread)
    thread.start()
    thread.join()
    statuses = []
    for t in os.listdir("/proc/self/task"):
        try:
            statuses.append(open(f"/proc/self/task/{t}/status").read())
        except FileNotFoundError:  # a thread that ended between the listing and the read
            pass
    confined = all("Seccomp:\t2" in s and "NoNewPrivs:\t1" in s and "CapEff:\t0000000000000000" in s for s in statuses)
    print("PROBE threads", "CONFINED" if confined else "OUTSIDE", len(statuses), file=sys.stderr)
attempt("write_private", lambda: open("own.txt", "w").write("x"))


class Cheat(Model):
    pass
'''
DENIED = ("read_file", "read_via_proc_root", "list_tmp", "write_tmp", "write_dev_shm", "write_kit", "parent_environ",
          "parent_fd", "parent_cwd", "tcp_connect", "tcp_bind", "unix_socket", "netlink_socket", "signal_parent",
          "sysv_shm", "sysv_msg", "posix_mq", "keyring", "xattr", "hostname", "udp_socket", "mptcp_socket",
          "io_uring", "setsid", "unshare", "read_etc_shadow", "inode_flags", "prlimit_parent", "clone_new_namespace",
          "bind_abstract", "mincore", "preadv2_nowait", "unix_datagram", "write_proc_sys", "write_sys", "write_var_tmp",
          "list_sys_kernel", "list_usr_share", "thread_read_file", "thread_unix_socket")


def test_the_sandbox_denies_what_it_says(tmp_path, checkpoint, text_dataset, honest_runs):
    import socket
    secret = tmp_path / "secret.txt"
    secret.write_text("the private shard")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    env = {"SUBMISSION_PROBE_SECRET": str(secret), "SUBMISSION_PROBE_PORT": str(listener.getsockname()[1]),
           "SUBMISSION_PROBE_KIT": str(REPO / "harness" / "config.py"), "AWS_SECRET_ACCESS_KEY": "not for the worker"}
    try:
        result, lines = evaluate(participant(tmp_path, "probe", PROBE), checkpoint, text_dataset, env=env)
        control, _ = evaluate(participant(tmp_path, "probe", PROBE), checkpoint, text_dataset, "--no-sandbox",
                              env={**env, "SUBMISSION_PROBE_CONTROL": "1"})
    finally:
        listener.close()
    assert result.returncode == 0, result.stderr[-3000:]
    probes = dict(line.split()[2:4] for line in result.stderr.splitlines() if line.startswith("[worker] PROBE "))
    assert {k: probes.get(k) for k in DENIED} == {k: "DENIED" for k in DENIED}, probes
    kinds = {line.split()[2]: line.split()[-1] for line in result.stderr.splitlines() if line.startswith("[worker] PROBE ")}
    assert kinds["mincore"] == kinds["prlimit_parent"] == kinds["bind_abstract"] == "PermissionError", kinds
    assert probes["metadata"] == "UNCHANGED" and probes["write_private"] == "ALLOWED" and probes["env"] == "HIDDEN"
    assert probes["threads"] == "CONFINED"  # every thread of the worker, by what the kernel reports of each
    # the worker's own cgroup: it cannot raise its limits, move itself out, or make a child of its own
    cgroups = ("cgroup_raise_memory", "cgroup_raise_pids", "cgroup_leave", "cgroup_child")
    if kernel_caps_here():
        from harness.worker.kernel_caps import PREFIX
        assert PREFIX in probes["cgroup_folder"], probes["cgroup_folder"]  # the probe found the cgroup the harness made
        assert {k: kinds[k] for k in cgroups} == {k: "PermissionError" for k in cgroups}, kinds
    else:  # the machine's own cgroup, which the worker cannot write either
        assert all(probes[k] in ("DENIED", "MISSING") for k in cgroups), probes
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]
    assert lines["sandbox"].startswith("capabilities + landlock-") and "seccomp" in lines["sandbox"]
    unsandboxed = dict(line.split()[2:4] for line in control.stderr.splitlines() if line.startswith("[worker] PROBE "))
    assert unsandboxed["read_file"] == unsandboxed["tcp_connect"] == unsandboxed["list_tmp"] == "ALLOWED"


def test_an_honest_model_gets_the_same_number_with_and_without_the_sandbox(tmp_path, checkpoint, text_dataset,
                                                                           honest_runs):
    result, lines = evaluate(participant(tmp_path, "train"), checkpoint, text_dataset, "--no-sandbox",
                             own_process=False)
    assert result.returncode == 0
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"] and lines["sandbox"].startswith("none")
    assert "the worker's sandbox is off (--no-sandbox)" in lines["official"]


def test_without_landlock_the_result_is_not_official(monkeypatch):
    from harness.worker import harness_side
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    abi, _, why = harness_side.sandbox_plan(True)
    assert abi == 0 and "no Landlock" in why
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 3)
    assert "Landlock ABI is 3" in harness_side.sandbox_plan(True)[2]


# --- CORE ------------------------------------------------------------------------------------------

def test_core_verification_that_never_answers_meets_the_deadline(tmp_path, text_dataset, checkpoint):
    kit = tmp_path / "kit"
    kit.mkdir()
    stall = ("import time\n\n\nclass Cheat(Model):\n    def forward(self, idx):\n"
             "        if __name__ == 'participant_train':  # only in the verification worker\n"
             "            time.sleep(10**6)\n        return self.honest(idx)\n")
    (kit / "train.py").write_text(Path(participant(tmp_path, "stall", stall)).read_text())
    (kit / "inference.py").write_text((REPO / "inference.py").read_text().replace(
        "self.max_seq_len = model.cos.shape[1]", "self.max_seq_len = None"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    t0 = time.time()
    result = run_prepare(["eval-core", "--inference-py", str(kit / "inference.py"), "--checkpoint", checkpoint,
                          "--bundle-dir", str(make_bundle(tmp_path)), "--timeout", "15"],  # 4x the 4 s to it, alone
                         {"FRONTIER_DATA_DIR": str(text_dataset), "TMPDIR": str(scratch)})
    assert result.returncode == 1, result.stdout
    assert "CORE did not finish within 15s" in result.stderr and "core:" not in result.stdout
    assert "centered:" in result.stdout  # the scoring finished: the stall was met where it was put
    assert time.time() - t0 < 15 + 30 and list(scratch.iterdir()) == []


# --- 13. what a worker leaves in its private folder ---------------------------------------------

LEAVE_BEHIND_CODE = '''
import os
import stat
import sys


def leave_behind(home):
    """Nesting deeper than the interpreter's recursion limit and paths longer than PATH_MAX, many
    files, folders and files without permissions, a FIFO, a socket, a hard link, symbolic links
    out of the folder."""
    os.chdir(home)
    os.mkdir("deep")
    os.chdir("deep")
    for _ in range(1100):  # 1,100 levels of 40 characters: a path of 45,000
        os.mkdir("n" * 40)
        os.chdir("n" * 40)
    open("bottom", "w").write("x" * 100_000)
    os.chdir(home)
    os.mkdir("many")
    for i in range(3000):
        open(f"many/{i}", "w").close()
    os.mkdir("odd")
    open("odd/file", "w").write("x")
    os.mkfifo("odd/fifo")
    os.mknod("odd/socket", 0o600 | stat.S_IFSOCK)
    os.link("odd/file", "odd/hard_link")
    os.symlink("/etc", "odd/to_etc")
    os.symlink(os.path.dirname(home), "to_parent")
    os.close(os.open("odd/no_permissions", os.O_CREAT | os.O_WRONLY, 0o000))
    os.mkdir("odd/closed", 0o000)
    os.mkdir("write_only", 0o300)
    open("write_only/hidden", "w").write("x")
    os.mkdir("write_only/closed", 0o000)
    print("LEFT BEHIND", file=sys.stderr, flush=True)
'''
LEAVE_BEHIND = LEAVE_BEHIND_CODE + '''

leave_behind(os.environ["HOME"])  # the worker's private folder


class Cheat(Model):
    pass
'''


def test_whatever_a_worker_leaves_is_removed(tmp_path, checkpoint, text_dataset, honest_runs):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    cheat = participant(tmp_path, "leave", LEAVE_BEHIND)
    result, lines = evaluate(cheat, checkpoint, text_dataset, env={"TMPDIR": str(scratch)}, own_process=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[worker] LEFT BEHIND" in result.stderr and "[worker.2] LEFT BEHIND" in result.stderr
    assert "Traceback" not in result.stderr and lines["val_bpb"] == honest_runs["public"]["val_bpb"]
    assert list(scratch.iterdir()) == []  # both workers' folders and the submission's copy are gone
    assert (Path("/etc") / "passwd").exists()  # the links were removed, not followed
    # The control: the same folder, removed as the harness removed it before (shutil.rmtree with
    # ignore_errors), raises past ignore_errors and leaves it behind.
    home = tmp_path / "control"
    home.mkdir()
    import shutil
    import subprocess
    subprocess.run([sys.executable, "-c", LEAVE_BEHIND_CODE + f"leave_behind({str(home)!r})\n"], check=True)
    with pytest.raises(RecursionError):
        shutil.rmtree(home, ignore_errors=True)
    assert home.exists()
    from harness.worker.limits import remove_tree
    remove_tree(home)
    assert not home.exists()


# --- 14. what a worker may consume --------------------------------------------------------------

CONSUME = '''
import mmap
import os
import socket
import sys
import threading
import time

HOW = os.environ["SUBMISSION_HOW"]
MIB = 1 << 20
HELD = []


def consume():
    chunk = b"x" * (16 * MIB)
    if HOW == "disk":  # gigabytes into the private folder
        with open(os.path.join(os.environ["HOME"], "flood"), "wb") as f:
            for _ in range(int(os.environ["SUBMISSION_MB"]) // 16):
                f.write(chunk)
                f.flush()
    elif HOW == "deleted_files":  # the same, in files it deleted and holds open, each under the cap
        for i in range(1024 // 32):
            held = open(os.path.join(os.environ["HOME"], f"hidden{i}"), "wb")
            os.unlink(held.name)
            held.write(chunk + chunk)
            held.flush()
            HELD.append(held)
    elif HOW == "processes":
        for _ in range(2000):
            if os.fork() == 0:
                time.sleep(3600)
                os._exit(0)
    elif HOW == "threads":
        for _ in range(2000):
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    elif HOW == "memory":
        held = [bytearray(chunk) for _ in range(4096 // 16)]
    elif HOW == "shared_memory":  # anonymous shared pages: not the process's anonymous memory
        held = mmap.mmap(-1, 4096 * MIB)
        for offset in range(0, len(held), 4096):
            held[offset] = 1
    elif HOW == "memory_file":  # a memfd it never maps
        fd = os.memfd_create("held")
        for _ in range(4096 // 16):
            os.write(fd, chunk)
    elif HOW == "passed_descriptors":  # memory files handed to a second process of its own, never received
        ours, theirs = socket.socketpair()
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
        for _ in range(2048 // 16):
            fd = os.memfd_create("passed")
            os.write(fd, chunk)
            socket.send_fds(ours, [b"x"], [fd])
            os.close(fd)
        theirs.close()
    elif HOW == "page_tables":  # the zero page read every 2 MiB of 1 TiB: no resident memory, 2 GiB of page tables
        mapped = mmap.mmap(-1, 1 << 40, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, prot=mmap.PROT_READ)
        HELD.append(sum(mapped[offset] for offset in range(0, len(mapped), 2 * MIB)))
    elif HOW == "socket_buffers":  # data queued in socket pairs nobody reads: kernel memory
        for _ in range(4000):
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            try:
                while True:
                    ours.send(chunk[:65536])
            except BlockingIOError:
                HELD.append((ours, theirs))
    elif HOW in ("folder_churn", "deep_descriptors"):  # first blind or stall the watchdog, then flood
        if HOW == "folder_churn":
            def churn():
                for i in range(10**9):
                    path = os.path.join(os.environ["HOME"], f"churn{i % 7}", "inner")
                    os.makedirs(path, exist_ok=True)
                    os.rmdir(path)
            threading.Thread(target=churn, daemon=True).start()
            time.sleep(8)
        else:  # a file 1,900 folders deep, held up to the descriptor limit by it and 20 children
            deep = os.environ["HOME"]
            for _ in range(1900):
                os.mkdir(os.path.join(deep, "d"))
                deep = os.path.join(deep, "d")
            fd = os.open(os.path.join(deep, "f"), os.O_CREAT | os.O_WRONLY)
            try:
                while True:
                    os.dup(fd)
            except OSError:
                pass
            for _ in range(20):
                if os.fork() == 0:
                    time.sleep(3600)
                    os._exit(0)
        held = [bytearray(chunk) for _ in range(2048 // 16)]
    print("CONSUMED", HOW, file=sys.stderr, flush=True)
    time.sleep(30)  # what it consumed stays consumed


consume()


class Cheat(Model):
    pass
'''
# how -> (the cap's variable, the cap, what the error says with the kernel's caps, with the watchdog's).
# A folder flood meets ENOSPC at the cap; files it deleted are freed when the worker fails, so the
# error may be the worker's own "No space left on device" rather than the harness's.
CAPS = {"disk": ("FRONTIER_WORKER_DISK_MB", "64", "into its private folder, up to its cap of 64 MiB",
                 "into its private folder, up to its cap of 64 MiB"),
        "deleted_files": ("FRONTIER_WORKER_DISK_MB", "64",  # the kernel's refusal, or the watchdog's stop at the cap
                          ("No space left on device", "into its private folder, up to its cap of 64 MiB"),
                          "into its private folder, up to its cap of 64 MiB"),
        "processes": ("FRONTIER_WORKER_TASKS", "64", "more processes and threads than its cap of 64: the kernel",
                      "processes and threads, more than its cap of 64"),
        "threads": ("FRONTIER_WORKER_TASKS", "64", "more processes and threads than its cap of 64: the kernel",
                    "processes and threads, more than its cap of 64"),
        "memory": ("FRONTIER_WORKER_MEMORY_MB", "1024", "more memory than its cap of 1024 MiB: the kernel's OOM",
                   "of memory, more than its cap of 1024 MiB"),
        "shared_memory": ("FRONTIER_WORKER_MEMORY_MB", "1024", "more memory than its cap of 1024 MiB: the kernel's OOM",
                          "of memory, more than its cap of 1024 MiB"),
        "memory_file": ("FRONTIER_WORKER_MEMORY_MB", "1024", "more memory than its cap of 1024 MiB: the kernel's OOM",
                        "of memory, more than its cap of 1024 MiB")}


# What user space cannot see or is kept from looking at, each past a 512 MiB memory cap: memory files
# queued in a socket, page tables, socket buffers; a watchdog blinded by folders that vanish under its
# walk, or stalled by a deep file held open 340,000 times, before a plain flood.
UNSEEN = ("passed_descriptors", "page_tables", "socket_buffers", "folder_churn", "deep_descriptors")


def kernel_caps_here() -> bool:
    """Whether this machine lets the harness leave the caps to the kernel (root, cgroups, tmpfs)."""
    from harness.worker import kernel_caps
    folder = Path(tempfile.mkdtemp())
    try:
        kernel_caps.create(folder, 1 << 30, 1 << 20, 10, 10, f"{kernel_caps.PREFIX}{os.getpid()}-probe").remove()
        return True
    except OSError:
        return False
    finally:
        folder.rmdir()


@pytest.fixture(params=["kernel", "watchdog"])
def caps_mode(request, monkeypatch):
    """Each cap test twice: with the kernel's caps (skipped where this machine cannot make them),
    and with the watchdog alone (kernel_caps.create refused, as on a machine without cgroups)."""
    from harness.worker import kernel_caps
    if request.param == "kernel" and not kernel_caps_here():
        pytest.skip("this machine does not let the harness create a cgroup and mount a tmpfs (needs root)")
    if request.param == "watchdog":
        def refused(*args, **kwargs):
            raise OSError(1, "refused for the test", "/sys/fs/cgroup")
        monkeypatch.setattr(kernel_caps, "create", refused)
    return request.param


def group_members(marker: str) -> list[int]:
    """Processes whose environment holds marker (what a worker started, if any survived)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("how", sorted(CAPS))
def test_a_worker_past_a_cap_is_stopped_with_one_clear_error(tmp_path, checkpoint, text_dataset, how, caps_mode):
    """The caps lowered for the test: a 1 GiB flood against 64 MiB, 2,000 processes or threads
    against 64, 4 GiB of memory against 1 GiB. The run stops in seconds, leaves nothing."""
    variable, cap, kernel_message, watchdog_message = CAPS[how]
    message = kernel_message if caps_mode == "kernel" else watchdog_message
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    marker = f"frontier-consume-{os.getpid()}-{how}"
    t0 = time.time()
    result, lines = evaluate(participant(tmp_path, how, CONSUME), checkpoint, text_dataset,
                             env={"SUBMISSION_HOW": how, "SUBMISSION_MB": "1024", "SUBMISSION_MARKER": marker,
                                  variable: cap, "TMPDIR": str(scratch)}, own_process=False)
    messages = message if isinstance(message, tuple) else (message,)
    assert_refused(result, lines, "" if isinstance(message, tuple) else "the model worker was stopped: it ")
    assert any(m in result.stderr for m in messages) and "CONSUMED" not in result.stderr.split("error:")[-1]
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1
    assert time.time() - t0 < 30  # the hostile's own sleep is 30 s: it was stopped, not waited for
    assert list(scratch.iterdir()) == [] and group_members(marker) == []


@pytest.mark.parametrize("how", UNSEEN)
def test_what_user_space_cannot_see_the_kernel_caps(tmp_path, checkpoint, text_dataset, how, caps_mode):
    """With the kernel's caps each is stopped at the memory cap. With the watchdog alone, the blinded
    and stalled watchdog still stops the flood that follows (it survives its look, or a look that runs
    out of time stops the worker); what it cannot see may be scored, but never officially."""
    seen = caps_mode == "kernel" or how in ("folder_churn", "deep_descriptors")
    cheat = CONSUME if seen else CONSUME.replace("time.sleep(30)", "pass")  # scored: no need to wait
    t0 = time.time()
    result, lines = evaluate(participant(tmp_path, how, cheat), checkpoint, text_dataset,
                             env={"SUBMISSION_HOW": how, "FRONTIER_WORKER_MEMORY_MB": "512"}, own_process=False)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert time.time() - t0 < 40, result.stderr[-3000:]  # the hostile's own sleep is 30 s
    if seen:
        assert_refused(result, lines, "the model worker was stopped: it ")
        assert ("more memory than its cap of 512 MiB" in result.stderr or
                (caps_mode == "watchdog" and ("its cap of 512 MiB" in result.stderr
                                              or "kept its watchdog from measuring it" in result.stderr))), \
            result.stderr[-3000:]
    else:  # the control: user space does not see it, and says the run is not official
        assert result.returncode == 0, result.stderr[-3000:]
        assert "caps could not be left to the kernel" in lines["official"], lines


def test_a_worker_under_its_caps_is_measured_and_scored(tmp_path, checkpoint, text_dataset, honest_runs, caps_mode):
    """The control: the same flood, 256 MiB, under the default cap, is scored, and what the worker
    wrote is what the harness measured. Caps left to the watchdog make the run not official."""
    result, lines = evaluate(participant(tmp_path, "disk", CONSUME.replace("time.sleep(30)", "pass")), checkpoint,
                             text_dataset, env={"SUBMISSION_HOW": "disk", "SUBMISSION_MB": "256"}, own_process=False)
    assert result.returncode == 0, result.stderr[-3000:]
    used = [line for line in result.stderr.splitlines() if line.startswith("[worker] used at most: ")]
    assert len(used) == 1 and 256 <= int(used[0].split("disk ")[1].split()[0]) < 300, used
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]
    assert ("caps could not be left to the kernel" in lines["official"]) == (caps_mode == "watchdog"), lines


# --- metadata: what the first worker reads, the second must not see ------------------------------------

BOARD = '''
import hashlib
import os
import sys

BOARD, HIDDEN = os.environ["SUBMISSION_BOARD"], os.environ["SUBMISSION_HIDDEN"]
# Three ways to leave a mark, four bits each, each beside a marker (moved: a first worker was here)
# and a reference nobody touches: reading a file, listing a folder (both where the sandbox lets the
# worker read), following a link (anywhere: a path's links are followed before the sandbox looks).
KINDS = {"files": (BOARD, "f", lambda p: open(p).read()), "folders": (BOARD, "d", os.listdir),
         "links": (HIDDEN, "l", os.stat)}


def moved(folder, name, prefix):
    """Its access time is later than its reference's by more than a worker's start could explain."""
    ref = os.lstat(os.path.join(folder, prefix + "ref")).st_atime_ns
    return os.lstat(os.path.join(folder, name)).st_atime_ns - ref > 200_000_000


for kind, (folder, prefix, touch) in KINDS.items():
    names = [prefix + s for s in ("ref", "marker", "0", "1", "2", "3")]
    view = [tuple(getattr(os.lstat(os.path.join(folder, n)), f) for f in
                  ("st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_size", "st_nlink")) for n in names]
    print("BOARD view", kind, hashlib.sha256(repr(view).encode()).hexdigest()[:16], file=sys.stderr)
    if moved(folder, prefix + "marker", prefix):
        got = "".join("1" if moved(folder, f"{prefix}{i}", prefix) else "0" for i in range(4))
        print("BOARD", kind, "second", got, file=sys.stderr)
        continue
    sent = "0000"
    while sent in ("0000", "1111"):
        sent = format(int.from_bytes(os.urandom(1), "big") % 16, "04b")
    touch(os.path.join(folder, prefix + "marker"))
    for i, bit in enumerate(sent):
        if bit == "1":
            touch(os.path.join(folder, f"{prefix}{i}"))
    print("BOARD", kind, "first", sent, file=sys.stderr)


class Cheat(Model):
    pass
'''


def board(tmp_path) -> dict:
    """Fresh files and folders on the worker's sys.path, and links in a folder it cannot read: none
    read yet (atime not after mtime, so relatime would move any of them)."""
    readable, hidden = tmp_path / "board", tmp_path / "hidden"
    readable.mkdir(parents=True)
    hidden.mkdir()
    for s in ("ref", "marker", "0", "1", "2", "3"):
        (readable / f"f{s}").write_text("x")
        (readable / f"d{s}").mkdir()
        (readable / f"d{s}" / "x").write_text("x")
        (hidden / f"l{s}").symlink_to("/usr/bin")
    return {"SUBMISSION_BOARD": str(readable), "SUBMISSION_HIDDEN": str(hidden), "PYTHONPATH": str(readable)}


DEFENCES_SET = ("import os, runpy, sys; from harness.worker import harness_side; "
                "harness_side.ATIME_DEFENCES = tuple(d for d in os.environ['TEST_ATIME_DEFENCES'].split(',') if d); "
                "sys.argv = ['prepare.py', *sys.argv[1:]]; runpy.run_path('prepare.py', run_name='__main__')")


def evaluate_with_defences(train_py, checkpoint, dataset, defences: tuple, env: dict):
    """`prepare.py eval-public` with harness_side.ATIME_DEFENCES set to defences (a control)."""
    import subprocess
    args = ["eval-public", "--train-py", train_py, "--checkpoint", checkpoint, "--device", "cpu", "--seq-len",
            str(SEQ), "--max-tokens", str(TOKENS)]
    result = subprocess.run([sys.executable, "-c", DEFENCES_SET, *args], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "FRONTIER_DATA_DIR": str(dataset), **env,
                                 "TEST_ATIME_DEFENCES": ",".join(defences)}, timeout=600)
    return result, result_lines(result.stdout)


def board_lines(stderr: str) -> dict:
    """kind -> [('first', bits sent) or ('second', bits decoded)], and kind -> the views, in worker order."""
    roles, views = {}, {}
    for line in stderr.splitlines():
        words = line.split()
        if len(words) == 5 and words[1] == "BOARD" and words[2] == "view":
            views.setdefault(words[3], []).append(words[4])
        elif len(words) == 5 and words[1] == "BOARD":
            roles.setdefault(words[2], []).append((words[3], words[4]))
    return roles, views


def assert_nothing_passed(roles, views, kinds):
    for kind in kinds:
        assert [r for r, _ in roles[kind]] == ["first", "first"], (kind, roles)
        assert len(views[kind]) == 2 and views[kind][0] == views[kind][1], (kind, views)


@pytest.mark.slow  # two evaluations, about 30 s
def test_what_a_worker_reads_or_lists_leaves_no_mark_for_the_next(tmp_path, checkpoint, text_dataset, honest_runs):
    """The first worker reads files, lists folders and follows links to send 12 bits; the second
    sees every entry's times, size and link count exactly as the first did (it never learns it is
    second). The control, with access times left to move, passes all 12 bits."""
    cheat = participant(tmp_path, "board", BOARD)
    result, lines = evaluate_with_defences(cheat, checkpoint, text_dataset, ("noatime", "read ahead"),
                                           board(tmp_path / "real"))
    assert result.returncode == 0, result.stderr[-3000:]
    roles, views = board_lines(result.stderr)
    if "noatime" in lines["sandbox"]:
        assert_nothing_passed(roles, views, ("files", "folders", "links"))
    else:  # no CAP_SYS_ADMIN: read ahead, links outside the readable folders still move
        assert_nothing_passed(roles, views, ("files", "folders"))
        assert "symbolic link" in lines["official"]
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]
    control, _ = evaluate_with_defences(cheat, checkpoint, text_dataset, (), board(tmp_path / "control"))
    assert control.returncode == 0, control.stderr[-3000:]
    roles, views = board_lines(control.stderr)
    for kind in ("files", "folders", "links"):
        (first, sent), (second, got) = roles[kind]
        assert (first, second) == ("first", "second") and got == sent, (kind, roles)


def test_reading_ahead_leaves_no_mark_without_a_mount_namespace(tmp_path, checkpoint, text_dataset, honest_runs):
    """Without the noatime namespace (as without CAP_SYS_ADMIN), the harness reads ahead: files and
    folders the worker may read keep their times; a link outside them still carries its bits, so
    the result is not official and says why."""
    cheat = participant(tmp_path, "board", BOARD)
    result, lines = evaluate_with_defences(cheat, checkpoint, text_dataset, ("read ahead",), board(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    roles, views = board_lines(result.stderr)
    assert_nothing_passed(roles, views, ("files", "folders"))
    (first, sent), (second, got) = roles["links"]
    assert (first, second) == ("first", "second") and got == sent, roles
    assert "noatime" not in lines["sandbox"] and "symbolic link" in lines["official"], lines
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]


def test_proc_moves_no_access_time():
    """Why the harness does not read /proc ahead: listing its folders and reading its files, which
    a worker may do, moves no time there."""
    paths = ["/proc/sys/kernel", "/proc/sys/kernel/pid_max", "/proc/loadavg", "/proc/stat", "/proc/1",
             f"/proc/{os.getpid()}/status", "/proc/sys/fs", "/proc/meminfo"]
    before = {p: os.lstat(p) for p in paths}
    for p in paths:
        os.listdir(p) if os.path.isdir(p) else open(p).read()
    after = {p: os.lstat(p) for p in paths}
    assert all((before[p].st_atime_ns, before[p].st_mtime_ns) == (after[p].st_atime_ns, after[p].st_mtime_ns)
               for p in paths)


def test_a_mount_where_every_read_moves_an_access_time_is_named():
    """strictatime (no relatime, no noatime) cannot be read ahead: the run says so. A read moves an
    atime not after the mtime or ctime, or a day old by the deadline, and nothing else."""
    from harness.worker import access_times
    root = os.path.realpath(REPO)
    dev = os.stat(root).st_dev
    strict = {dev: access_times.Mount("/strict", "ext4", {"rw"})}
    assert access_times.strict_mounts([root], strict) == ["/strict"]
    for options in ({"rw", "relatime"}, {"rw", "noatime"}):
        assert access_times.strict_mounts([root], {dev: access_times.Mount("/m", "ext4", options)}) == []
    from types import SimpleNamespace as Times
    now, day = time.time_ns(), access_times.DAY_NS
    assert not access_times.would_move(Times(st_atime_ns=now, st_mtime_ns=now - 10, st_ctime_ns=now - 10), now - day)
    assert access_times.would_move(Times(st_atime_ns=now, st_mtime_ns=now, st_ctime_ns=now - 10), now - day)
    assert access_times.would_move(Times(st_atime_ns=now, st_mtime_ns=now - 10, st_ctime_ns=now + 1), now - day)
    assert access_times.would_move(Times(st_atime_ns=now - day, st_mtime_ns=0, st_ctime_ns=0), now - day)


# --- the kernel's caches: what the first worker read, the second must not be able to time ------------

PAGE_BOARD = '''
import os
import statistics
import sys
import time

BOARD = os.environ["SUBMISSION_BOARD"]
# Four bits in the page cache, beside a marker (cached: a first worker was here): which of four
# files that nobody had read are cached. A page is cached when its first read is not much slower than
# a second read of it (uncached: 30 to 260 times slower on the development machine).
OFFSETS = [k << 20 for k in range(8)]  # 1 MiB apart: each in a readahead window of its own


def cached(name):
    fd = os.open(os.path.join(BOARD, name), os.O_RDONLY)
    ratios = []
    for offset in OFFSETS:
        t0 = time.perf_counter_ns()
        os.pread(fd, 1, offset)
        t1 = time.perf_counter_ns()
        os.pread(fd, 1, offset)
        ratios.append((t1 - t0) / max(1, time.perf_counter_ns() - t1))
    os.close(fd)
    return statistics.median(ratios) < 8


if cached("marker"):
    got = "".join("1" if cached(f"p{i}") else "0" for i in range(4))
    print("BOARD pages second", got, file=sys.stderr)
else:
    sent = "0000"
    while sent in ("0000", "1111"):
        sent = format(int.from_bytes(os.urandom(1), "big") % 16, "04b")
    for i, bit in enumerate(sent):
        if bit == "1":
            cached(f"p{i}")
    print("BOARD pages first", sent, file=sys.stderr)


class Cheat(Model):
    pass
'''


def page_board(tmp_path) -> dict:
    """Five 8 MiB files on the worker's sys.path that nobody has read since they left the page cache."""
    folder = tmp_path / "pages"
    folder.mkdir(parents=True)
    for name in ("marker", "p0", "p1", "p2", "p3"):
        with open(folder / name, "wb") as f:
            f.write(os.urandom(8 << 20))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return {"SUBMISSION_BOARD": str(folder), "PYTHONPATH": str(folder)}


@pytest.mark.xdist_group("kernel-caches")  # no other test's drop may come between its workers
def test_what_a_worker_reads_leaves_nothing_in_the_page_cache_for_the_next(tmp_path, checkpoint, text_dataset,
                                                                            honest_runs):
    """The first worker sends 4 bits by reading chosen files (their pages stay cached); the second
    times a first and a second read of each. With the kernel's caches dropped between the workers,
    the second finds nothing cached and takes itself for the first; the control, with the caches
    kept (FRONTIER_KEEP_KERNEL_CACHES=1, not official), passes all 4 bits."""
    cheat = participant(tmp_path, "pages", PAGE_BOARD)
    result, lines = evaluate(cheat, checkpoint, text_dataset,
                             env={**page_board(tmp_path / "real"), "FRONTIER_KEEP_KERNEL_CACHES": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    roles, _ = board_lines(result.stderr)
    if can_drop_kernel_caches():
        assert [r for r, _ in roles["pages"]] == ["first", "first"], roles
        assert "the kernel's caches dropped before the second in" in lines["workers"], lines
        assert "kernel's caches" not in lines["official"], lines
    else:  # not root: the run says it is not official, and why
        assert "the kernel's caches could not be dropped" in lines["official"], lines
    assert lines["val_bpb"] == honest_runs["public"]["val_bpb"]
    # The control may be hit by a drop of another test's evaluation, running at the same time on the
    # other test worker (the caches are the machine's): a lost control is tried again, up to 3 times.
    tries = []
    for attempt in range(3):
        control, control_lines = evaluate(cheat, checkpoint, text_dataset,
                                          env={**page_board(tmp_path / f"control{attempt}"),
                                               "FRONTIER_KEEP_KERNEL_CACHES": "1"})
        assert control.returncode == 0, control.stderr[-3000:]
        (first, sent), (second, got) = board_lines(control.stderr)[0]["pages"]
        tries.append((first, sent, second, got))
        if (first, second) == ("first", "second") and got == sent:
            break
    assert (first, second) == ("first", "second") and got == sent, tries
    assert "kept between the workers (FRONTIER_KEEP_KERNEL_CACHES)" in control_lines["official"], control_lines


def test_caches_that_cannot_be_dropped_or_are_kept_make_the_run_not_official(tmp_path, monkeypatch):
    """The drop's two ways out, each a reason the run is not official (the drop itself is tested
    end to end above): the setting that keeps the caches, and a machine that refuses the drop."""
    from harness.worker import harness_side
    monkeypatch.setenv("FRONTIER_KEEP_KERNEL_CACHES", "1")
    assert harness_side.drop_kernel_caches() == (None, [
        "the kernel's caches were kept between the workers (FRONTIER_KEEP_KERNEL_CACHES): the second worker could "
        "time which files and names the first read"])
    monkeypatch.setenv("FRONTIER_KEEP_KERNEL_CACHES", "0")
    monkeypatch.setattr(harness_side, "DROP_CACHES", tmp_path / "no-such-folder" / "drop_caches")
    seconds, reasons = harness_side.drop_kernel_caches()
    assert seconds is None and len(reasons) == 1 and "could not be dropped" in reasons[0], reasons
    assert "No such file or directory; that needs root and a writable /proc/sys" in reasons[0], reasons
    monkeypatch.setenv("FRONTIER_KEEP_KERNEL_CACHES", "maybe")
    with pytest.raises(Exception, match="FRONTIER_KEEP_KERNEL_CACHES='maybe': expected 1/0"):
        harness_side.drop_kernel_caches()


# --- the watchdog itself: whatever a look meets, the worker is stopped, never left unwatched ------------

def _watchdog(tmp_path, killed):
    from harness.worker.limits import Limits, Watchdog
    big = 1 << 40
    return Watchdog(os.getpgrp(), tmp_path, Limits(memory=big, disk=big, files=10**6, tasks=10**6),
                    lambda: killed.append(1))


@pytest.mark.parametrize("breaks", ["a look raises", "the loop itself raises", "a look takes too long"])
def test_a_watchdog_that_cannot_look_stops_the_worker(tmp_path, monkeypatch, breaks):
    from harness.worker import limits
    killed = []
    watchdog = _watchdog(tmp_path, killed)
    if breaks == "a look raises":
        monkeypatch.setattr(watchdog, "_look", lambda *a: 1 / 0)
    elif breaks == "the loop itself raises":
        monkeypatch.setattr(watchdog, "_safe_look", lambda *a: 1 / 0)
    else:
        monkeypatch.setattr(limits, "LOOK_SECONDS", 0.0)
        monkeypatch.setattr(watchdog, "_look", lambda w, d, o, deadline: limits.folder_use(tmp_path, 10, deadline))
    watchdog.start()
    watchdog._thread.join(timeout=10)
    assert not watchdog._thread.is_alive() and killed and watchdog.reason
    expected = {"a look raises": "made its watchdog fail (ZeroDivisionError)",
                "the loop itself raises": "outlived its watchdog (ZeroDivisionError)",
                "a look takes too long": "kept its watchdog from measuring it"}[breaks]
    assert watchdog.reason.startswith(expected), watchdog.reason


def test_a_watchdog_left_alone_neither_stops_nor_dies(tmp_path):
    killed = []
    watchdog = _watchdog(tmp_path, killed)
    watchdog.start()
    time.sleep(1.0)
    assert watchdog._thread.is_alive()
    watchdog.stop()
    assert not killed and not watchdog.reason and watchdog.peak.tasks >= 1


def test_the_folder_walk_survives_folders_that_vanish_under_it(tmp_path):
    import threading
    from harness.worker.limits import folder_use
    for i in range(200):
        (tmp_path / f"d{i}" / "e").mkdir(parents=True)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            for i in range(200):
                for path in (tmp_path / f"d{i}" / "e", tmp_path / f"d{i}"):
                    try:
                        path.rmdir()
                    except OSError:
                        pass
                (tmp_path / f"d{i}" / "e").mkdir(parents=True, exist_ok=True)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(50):
            disk, files = folder_use(tmp_path, 10**6)
            assert 0 <= files <= 400
    finally:
        stop.set()
        thread.join()
