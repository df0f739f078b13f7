"""Bad input to `skiplock run` / `demo`, found before anything starts: scenario files (UTF-8,
empty, TOML types), scenario names and the run directory, `--out`, `--dsn` and the redaction
of passwords, plug-in factories, and the demo's honest name and agreeing tables."""

from __future__ import annotations

import dataclasses
import itertools
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.queue_impl.plugins import (
    DSN_HIDDEN,
    BackendSpec,
    check_backend,
    dsn_problem,
    dsn_view,
    parse_backend_options,
    redact,
    scrub,
    shown_options,
)
from skiplock.scenarios.cli.run import check_dsn, check_out
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.spec import NAME_MAX, SpecError
from skiplock.scenarios.servers.postgres import _scrub, redact_dsn

# --- scenario files -------------------------------------------------------------------------


def _file(tmp_path: Path, text: str | bytes, name: str = "mine.toml") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path) -> None:
    path = _file(tmp_path, b'duration = 3\nname = "caf\xe9"\n')
    with pytest.raises(SpecError) as caught:
        spec_mod.load(path)
    message = str(caught.value)
    assert f"scenario file {path} is not UTF-8" in message
    assert "line 2" in message and "\n" not in message


def test_a_byte_order_mark_is_tolerated(tmp_path: Path) -> None:
    spec = spec_mod.load(_file(tmp_path, "\ufeffduration = 3\n".encode()))
    assert spec.duration == 3.0


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing but a comment\n"])
def test_an_empty_file_is_refused_not_run_as_the_defaults(tmp_path: Path, text: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(SpecError, match=f"scenario file {path} is empty"):
        spec_mod.load(path)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('recovery = "yes"', "recovery must be true or false (a TOML boolean), not a string"),
        ('recovery = "true"', "(write recovery = true)"),
        ("recovery = 1", "recovery must be true or false (a TOML boolean), not an integer"),
        ("name = 5", "name must be a string, not an integer (5)"),
        ("description = true", "description must be a string, not a boolean"),
        ('workers = "4"', "workers must be a whole number, not a string ('4') (write workers = 4)"),
        ("workers = 2.0", "workers must be a whole number, not a float (2.0)"),
        ("workers = true", "workers must be a whole number, not a boolean"),
        ('duration = "10"', "duration must be a number, not a string"),
        ("duration = false", "duration must be a number, not a boolean"),
        ("lease = [1]", "lease must be a number, not an array"),
    ],
)
def test_toml_values_must_have_their_keys_type(tmp_path: Path, line: str, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec_mod.load(_file(tmp_path, f"{line}\n"))
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('[accounts]\nacme = "4"\n', "accounts.acme must be a whole number or \"unlimited\""),
        ("[accounts]\nacme = 1.5\n", "accounts.acme must be a whole number"),
        ("[accounts]\nacme = true\n", "accounts.acme must be a whole number"),
        ('[mix]\nslow = "2"\n', "mix.slow must be a number, not a string"),
        ("[failpoints]\ncrash_after_claim = true\n", "failpoints.crash_after_claim must be a"),
    ],
)
def test_table_values_must_be_numbers_too(tmp_path: Path, table: str, expected: str) -> None:
    with pytest.raises(SpecError, match=re.escape(expected)):
        spec_mod.load(_file(tmp_path, f"duration = 3\n{table}"))


def test_a_number_key_takes_an_integer_and_unlimited_stays_a_word(tmp_path: Path) -> None:
    spec = spec_mod.load(_file(tmp_path, textwrap.dedent("""\
        duration = 10
        lease = 12
        [accounts]
        acme = 4
        bulk = "unlimited"
        [mix]
        succeed = 3
        slow = 0.5
    """)))
    assert spec.duration == 10.0 and isinstance(spec.duration, float)
    assert spec.accounts == {"acme": 4, "bulk": None}
    assert spec.mix == {"succeed": 3.0, "slow": 0.5}


def test_set_strings_still_convert() -> None:
    spec = spec_mod.load("steady", ["recovery=false", "renew_leases=yes", "workers=4",
                                    "duration=2.5", "accounts.extra=unlimited", "mix.slow=2"])
    assert spec.recovery is False and spec.renew_leases is True
    assert spec.workers == 4 and spec.duration == 2.5
    assert spec.accounts["extra"] is None and spec.mix["slow"] == 2.0


def test_spec_json_still_reads_back() -> None:
    spec = spec_mod.load("faulty-targets", ["accounts.bulk=unlimited"])
    assert spec_mod.from_mapping(spec.to_json()).validate() == spec


# --- names and the run directory ------------------------------------------------------------


@pytest.mark.parametrize("name", ["steady", "my-run_2", "v1.2", "_x", "9", "a" * NAME_MAX])
def test_plain_names_are_accepted(name: str) -> None:
    assert spec_mod.load("steady", [f"name={name}"]).name == name


@pytest.mark.parametrize(
    "name",
    ["../escaped", "a/b", "/etc", "..", ".hidden", "a b", "x\\y", "caf\u00e9", "a\nb",
     "a" * (NAME_MAX + 1), ""],
)
def test_names_that_are_not_a_plain_file_name_part_are_refused(name: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec_mod.ScenarioSpec(name=name).validate()
    assert "cannot name a run directory" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_bad_names_are_refused_from_a_file_and_from_set(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=re.escape("'../x' cannot name a run directory")):
        spec_mod.load(_file(tmp_path, 'name = "../x"\n'))
    with pytest.raises(SpecError, match=re.escape("'../x' cannot name a run directory")):
        spec_mod.load("steady", ["name=../x"])
    # The default name is the file's; a file name with a space needs a `name`.
    with pytest.raises(SpecError, match="'my run' cannot name"):
        spec_mod.load(_file(tmp_path, "duration = 3\n", name="my run.toml"))


def test_new_run_dir_stays_inside_out(tmp_path: Path) -> None:
    from skiplock.scenarios.run.runner import new_run_dir

    out = tmp_path / "runs"
    run_dir = new_run_dir(out, spec_mod.ScenarioSpec(name="ok"), 1)
    assert run_dir.parent == out and run_dir.is_dir()
    # A name that skipped validation still cannot put the run elsewhere.
    for bad in ("../../escaped", "/x", "a/../../b"):
        with pytest.raises(UsageError, match="outside --out"):
            new_run_dir(out, dataclasses.replace(spec_mod.ScenarioSpec(name="ok"), name=bad), 1)
    assert sorted(tmp_path.rglob("*")) == [out, run_dir]


def test_a_removed_run_takes_only_the_empty_folders_it_made(tmp_path: Path) -> None:
    from skiplock.scenarios.run.runner import missing_folders, new_run_dir, remove_if_empty

    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "a" / "b"
    made = missing_folders(out)
    assert made == [out, out.parent]
    run_dir = new_run_dir(out, spec_mod.ScenarioSpec(name="ok"), 1)
    (out.parent / "other").write_text("")  # something else now lives in a/
    run_dir.rmdir()
    remove_if_empty(made)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "kept", "other"]
    assert missing_folders(tmp_path) == []


def test_new_run_dir_under_a_file_is_a_usage_error(tmp_path: Path) -> None:
    from skiplock.scenarios.run.runner import new_run_dir

    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(UsageError, match=f"--out {out}: cannot create"):
            new_run_dir(out, spec_mod.ScenarioSpec(name="ok"), 1)


def test_check_out(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    check_out(tmp_path)
    check_out(tmp_path / "not" / "yet")  # created by the run, not here
    assert not (tmp_path / "not").exists()
    with pytest.raises(UsageError, match="is a file: give a directory"):
        check_out(tmp_path / "afile")
    with pytest.raises(UsageError, match="afile is a file, not a directory"):
        check_out(tmp_path / "afile" / "deeper" / "still")


# --- DSNs: never any part of a password -----------------------------------------------------

# (DSN, the password as its writer meant it). Every one is hostile to a naive redactor.
HOSTILE = [
    ("postgresql://bob:Pq7@zZ9@db.example:5432/app", "Pq7@zZ9"),  # unescaped @
    ("postgresql://bob:Pq7/zZ9@db.example/app", "Pq7/zZ9"),  # unescaped /
    ("postgresql://bob:Pq7@zZ9/xY@db.example/app", "Pq7@zZ9/xY"),
    ("postgresql://bob:Pq7?zZ9@db.example/app", "Pq7?zZ9"),
    ("postgresql://bob:Pq7#zZ9@db.example/app", "Pq7#zZ9"),
    ("postgresql://bob:Pq7:zZ9@db.example/app", "Pq7:zZ9"),
    ("postgresql://bob:Pq7%zz@db.example/app", "Pq7%zz"),  # invalid percent-encoding
    ("postgresql://bob:" + quote("Pq7@zZ9/x", safe="") + "@db.example/app", "Pq7@zZ9/x"),
    ("postgresql://db.example/app?password=Pq7zZ9xY", "Pq7zZ9xY"),
    ("postgresql://db.example/app?user=bob&sslpassword=Pq7zZ9xY", "Pq7zZ9xY"),
    ("postgres://bob:Pq7zZ9xY@[::1]:5433/app?sslmode=disable", "Pq7zZ9xY"),
    ("host=db.example user=bob password=Pq7zZ9xY dbname=app", "Pq7zZ9xY"),
    ("host=db.example password='Pq7 zZ9 xY' dbname=app", "Pq7 zZ9 xY"),
    ("host=db.example password='Pq7zZ9xY", "Pq7zZ9xY"),  # unbalanced quote
    ("password=Pq7zZ9xY host", "Pq7zZ9xY"),  # a stray word
]


def _pieces(password: str) -> list[str]:
    """The password, and every piece of it between characters a URI reserves."""
    parts = [p for p in itertools.chain.from_iterable(
        part.split("/") for part in password.replace("?", "@").replace("#", "@")
        .replace(":", "@").replace(" ", "@").split("@")) if len(p) >= 3]
    return [password, *parts]


@pytest.mark.parametrize(("dsn", "password"), HOSTILE)
def test_redaction_never_shows_any_part_of_a_password(dsn: str, password: str) -> None:
    shown = [redact(dsn), redact_dsn(dsn), BackendSpec(name="pg", dsn=dsn).display(),
             repr(BackendSpec(name="pg", dsn=dsn))]
    for text in shown:
        for piece in _pieces(password):
            assert piece not in text, (dsn, text)
    view = dsn_view(dsn)
    if view.trusted:
        # libpq reads the password as written and never quotes it back: it is cut out of a
        # message wherever it appears, and the DSN with it.
        echo = f'password "{password}" rejected; {dsn}'
        assert password not in scrub(echo, dsn) and password not in _scrub(echo, dsn)
        assert "db.example" in view.display or "::1" in view.display
        return
    # A misread DSN: libpq quotes back values holding pieces of the password (a host
    # "zZ9@db.example", a port "Pq7"), so the message is replaced whole.
    for piece in _pieces(password):
        echo = f'could not translate host name "{piece}@db.example" (port "{piece}") {dsn}'
        assert piece not in scrub(echo, dsn) and piece not in _scrub(echo, dsn)


def test_a_dsn_read_as_written_is_shown_with_its_host_and_user() -> None:
    shown = redact("postgresql://bob:Pq7zZ9xY@db.example:5432/app")
    assert shown == "user=bob password=*** dbname=app host=db.example port=5432"


def test_a_misread_dsn_shows_its_host_at_most() -> None:
    assert redact("postgresql://bob:Pq7@zZ9@db.example:5432/app") \
        == f"postgresql://db.example:5432 {DSN_HIDDEN}"
    assert redact("host=db.example password='Pq7") == f"host=db.example {DSN_HIDDEN}"
    assert redact("password='Pq7 host=db.example") == DSN_HIDDEN


def test_a_short_password_is_cut_where_it_stands_not_inside_words() -> None:
    dsn = "postgresql://bob:p@127.0.0.1:1/db"
    text = ('connection to server at "127.0.0.1", port 1 failed: is the server accepting'
            " TCP/IP connections? password p rejected")
    scrubbed = scrub(text, dsn)
    assert "port 1 failed" in scrubbed and "accepting" in scrubbed
    assert scrubbed.endswith("password *** rejected")
    assert redact(dsn) == "user=bob password=*** dbname=db host=127.0.0.1 port=1"


def test_scrub_without_a_dsn_keeps_the_text_on_one_line() -> None:
    assert scrub("a\n  b", None) == "a b" == _scrub("a\n  b", "")


@pytest.mark.parametrize(
    ("dsn", "problem"),
    [
        ("postgresql://bob:Pq7@zZ9@db.example/app", "percent-encode it"),
        ("postgresql://bob:Pq7/zZ9@db.example/app", "percent-encode it"),
        ("postgresql://bob:Pq7%zz@db.example/app", "cannot be parsed"),
        ("host=db.example password='Pq7", "cannot be parsed"),
        ("postgresql://bob:" + quote("Pq7@zZ9", safe="") + "@db.example/app", None),
        ("postgresql://bob:Pq7zZ9@db.example/app?application_name=a@b", None),
        ("postgresql://bob:Pq7?zZ9@db.example/app", None),
        ("host=db.example password=Pq7zZ9", None),
    ],
)
def test_dsn_problem(dsn: str, problem: str | None) -> None:
    found = dsn_problem(dsn)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_check_dsn_refuses_an_empty_or_misread_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKIPLOCK_PG_DSN", raising=False)
    for empty in ("", "   "):
        with pytest.raises(UsageError, match="--dsn is empty"):
            check_dsn(empty)
    with pytest.raises(UsageError) as caught:
        check_dsn("postgresql://bob:Pq7@zZ9@db.example/app")
    assert str(caught.value).startswith("--dsn postgresql://db.example")
    assert "zZ9" not in str(caught.value) and "Pq7" not in str(caught.value)
    monkeypatch.setenv("SKIPLOCK_PG_DSN", "postgresql://bob:Pq7/zZ9@db.example/app")
    with pytest.raises(UsageError, match=r"^SKIPLOCK_PG_DSN "):
        check_dsn(None)
    check_dsn("postgresql://bob@db.example/app")  # a given --dsn wins over the environment


# --- plug-in factories ----------------------------------------------------------------------

PLUGIN = '''
from skiplock.queue_impl.memory import InMemoryQueue

class Queue:
    """A QueueBackend in shape only; this module counts what is built and closed."""
    name = "fake"
    def setup(self): pass
    def upsert_accounts(self, accounts): pass
    def enqueue(self, jobs): pass
    def claim(self, worker_id, batch, lease): return []
    def finish(self, results): return []
    def renew(self, leases, extend): return []
    def release(self, leases): return []
    def recover(self, limit=100): return 0
    def wait_for_work(self, timeout): return False
    def snapshot(self): return []
    def close(self):
        CLOSED.append(self)

class LocalQueue(Queue):
    shared = False

class BadClose(Queue):
    def close(self):
        raise OSError("socket already gone")

CALLS = []
CLOSED = []

def good(*, dsn, schema, sql_path):
    CALLS.append((dsn, schema, sql_path))
    return Queue()

def raises(**kw):
    raise RuntimeError(f"cannot reach my broker with {kw['dsn']}")

def returns_none(**kw):
    return None

def returns_text(**kw):
    return "a queue"

def positional_only(dsn):
    return Queue()

def local_class(**kw):
    return LocalQueue()

def local_factory(**kw):
    return Queue()
local_factory.shared = False

def memory(**kw):
    return InMemoryQueue()

def bad_close(**kw):
    return BadClose()
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A plug-in module on sys.path, under a name no other test imports."""
    import importlib
    import uuid

    name = f"skiplock_test_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


DSN = "postgresql://bob:Pq7zZ9xY@127.0.0.1:5432/app"


def test_a_good_factory_is_called_once_and_closed(plugin: str) -> None:
    import importlib

    check_backend(f"{plugin}:good", dsn=DSN, schema="s1", sql_path="q.sql")
    module = importlib.import_module(plugin)
    assert module.CALLS == [(DSN, "s1", "q.sql")]
    assert len(module.CLOSED) == 1


@pytest.mark.parametrize(
    ("attr", "expected"),
    [
        ("raises", "the factory raised RuntimeError (cannot reach my broker with user=bob"
                   " password=*** dbname=app host=127.0.0.1 port=5432)"),
        ("returns_none", "the factory returned None; it must return a QueueBackend"),
        ("returns_text", "the factory returned str, which does not implement QueueBackend"),
        ("positional_only", "cannot be called as factory(dsn=..., schema=..., sql_path=...)"),
        ("local_class", "its queue lives inside one process"),
        ("local_factory", "its queue lives inside one process"),
        ("memory", "its queue lives inside one process"),
        ("bad_close", "close() of the queue the factory returned raised OSError"
                      " (socket already gone)"),
        ("absent", "has no callable 'absent'"),
    ],
)
def test_a_factory_that_cannot_serve_a_run_is_one_line_naming_it(
    plugin: str, attr: str, expected: str
) -> None:
    with pytest.raises(ValueError) as caught:
        check_backend(f"{plugin}:{attr}", dsn=DSN, schema="s", sql_path=None)
    message = str(caught.value)
    assert message.startswith(f"backend '{plugin}:{attr}': ")
    assert expected in message
    assert "\n" not in message and "Pq7zZ9xY" not in message


def test_the_in_memory_model_is_refused_for_runs_but_still_builds_in_one_process() -> None:
    with pytest.raises(ValueError, match="lives inside one process"):
        check_backend("skiplock.queue_impl.memory:factory", dsn=DSN, schema="s")
    from skiplock.queue_impl.memory import InMemoryQueue

    backend = BackendSpec(name="skiplock.queue_impl.memory:factory").create()
    assert isinstance(backend, InMemoryQueue)


def test_reference_backends_need_no_call() -> None:
    for name in ("pg", "pg-naive", "pg-for-update", "pg-long-tx"):
        check_backend(name, dsn="postgresql://127.0.0.1:9/none", schema="s")


# --- the demo -------------------------------------------------------------------------------


def test_the_demo_names_and_describes_what_it_mixes_in() -> None:
    from skiplock.scenarios.cli.demo import DEMO_DEFAULTS, demo_spec

    spec = demo_spec(spec_mod.load("steady", DEMO_DEFAULTS), [])
    assert spec.name == "demo"
    assert "fault-free" not in spec.description
    for words in ("succeed", "fail_then_succeed (503 x2, then 200)",
                  "always_400 (400: a dead letter at once)", "slow (200 after 0.2 s)"):
        assert words in spec.description
    assert spec.to_json()["name"] == "demo"
    # What the user names stays theirs; a mix they change is what the description says.
    mine = demo_spec(spec_mod.load("steady", [*DEMO_DEFAULTS, "name=mine", "mix.slow=0"]),
                     ["name=mine", "mix.slow=0"])
    assert mine.name == "mine" and "slow" not in mine.description


def test_the_live_table_and_the_summary_count_deliveries_alike(tmp_path: Path) -> None:
    from skiplock.reports.history import (
        DELIVERIES_DIR,
        DELIVERY_LOG,
        ENQUEUE_LOG,
        ENQUEUES_FILE,
        LogWriter,
    )
    from skiplock.scenarios.cli.demo import summary_table
    from skiplock.scenarios.run.progress import LABELS, Sampler, _table

    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        for job in ("a", "b"):
            enq.write({"type": "invoke", "job_id": job, "time": 100.0, "max_attempts": 3})
            enq.write({"type": "ok", "job_id": job, "time": 100.1})
    with LogWriter(tmp_path / DELIVERIES_DIR / "target-0.csv", DELIVERY_LOG) as dels:
        dels.write({"job_id": "a", "received": 100.2, "answered": 100.3, "status": 503})
        dels.write({"job_id": "a", "received": 101.0, "answered": 101.1, "status": 200})
        dels.write({"job_id": "b", "received": 100.2, "answered": 100.3, "status": 400})
        dels.write({"job_id": "b", "received": 100.4, "answered": None, "status": None})
    sample = Sampler(tmp_path, dsn=None, schema="s").sample("done", final=True)
    live = _table(sample, "demo on pg")
    live_rows = dict(zip(map(str, live.columns[0].cells), map(str, live.columns[1].cells),
                         strict=True))
    verdict = SimpleNamespace(counts={"enqueued": 2, "delivered": 4, "completed": 1,
                                      "failed": 1, "lost": 0, "duplicate_explained": 0},
                              valid=True)
    summary = summary_table(tmp_path, verdict, 17.0, 2.0)
    summary_rows = dict(zip(map(str, summary.columns[0].cells),
                            map(str, summary.columns[1].cells), strict=True))
    assert live_rows[LABELS["delivered"]] == summary_rows[LABELS["delivered"]] == "4"
    assert live_rows[LABELS["delivered_ok"]] == summary_rows[LABELS["delivered_ok"]] == "1"
    assert live_rows[LABELS["enqueued"]] == summary_rows[LABELS["enqueued"]] == "2"


# --- plug-in options: --backend-opt ----------------------------------------------------------

OPTIONED = '''
from skiplock.queue_impl.memory import InMemoryQueue

SEEN = []

class Queue(InMemoryQueue):
    shared = True

def takes_queue_name(*, dsn, schema, sql_path, queue_name="default"):
    SEEN.append(queue_name)
    return Queue()
'''


def test_options_reach_the_factory_and_an_unknown_one_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import uuid

    name = f"skiplock_test_options_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(OPTIONED)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    check_backend(f"{name}:takes_queue_name", dsn=DSN, schema="s",
                  options=(("queue_name", "emails"),))
    assert importlib.import_module(name).SEEN == ["emails"]
    with pytest.raises(ValueError) as caught:
        check_backend(f"{name}:takes_queue_name", dsn=DSN, schema="s",
                      options=(("queue_name", "x"), ("nope", "1")))
    assert str(caught.value).startswith(
        f"backend '{name}:takes_queue_name': its factory takes no option 'nope'")
    # Through a producer's JSON config the pairs come back as lists, and still build.
    spec = BackendSpec(name=f"{name}:takes_queue_name", dsn=DSN,
                       options=[["queue_name", "sms"]])  # type: ignore[arg-type]
    assert spec.options == (("queue_name", "sms"),)
    spec.create().close()
    assert importlib.import_module(name).SEEN[-1] == "sms"


def test_a_reference_backend_takes_no_options() -> None:
    with pytest.raises(ValueError, match="takes no --backend-opt"):
        check_backend("pg", dsn=DSN, schema="s", options=(("a", "1"),))


@pytest.mark.parametrize(("items", "expected"), [
    (["queue_name=emails", "limit=3"], (("queue_name", "emails"), ("limit", "3"))),
    (["url=redis://h/0?x=1"], (("url", "redis://h/0?x=1"),)),
    (["empty="], (("empty", ""),)),
])
def test_backend_options_parse_in_order(items: list[str],
                                        expected: tuple[tuple[str, str], ...]) -> None:
    assert parse_backend_options(items) == expected


@pytest.mark.parametrize(("items", "message"), [
    (["noequals"], "--backend-opt takes KEY=VALUE"),
    (["9lives=1"], "--backend-opt takes KEY=VALUE"),
    (["a-b=1"], "--backend-opt takes KEY=VALUE"),
    (["a=1", "a=2"], "--backend-opt a is given twice"),
])
def test_a_malformed_backend_option_is_one_line(items: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_backend_options(items)


def test_secret_looking_options_are_never_shown() -> None:
    spec = BackendSpec(name="m:f", options=(("api_token", "t0k3n"), ("queue", "q")))
    assert shown_options(spec.options) == {"api_token": "***", "queue": "q"}
    assert "t0k3n" not in spec.display() and "queue=q" in spec.display()


def test_locusts_note_about_a_user_that_already_ended_is_not_printed() -> None:
    """Stopping users at the end of the load, Locust logs an error for a user that stopped
    itself; the producers drop that one line (in a child: importing them patches the world)."""
    import subprocess
    import sys

    code = (
        "import logging, skiplock.scenarios.run.producers\n"
        "log = logging.getLogger('locust.runners')\n"
        "log.error(\"While stopping users, we encountered a user that didn't have proper "
        "args %s\", 'g')\n"
        "log.error('a real error')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert "proper args" not in done.stderr
    assert "a real error" in done.stderr
