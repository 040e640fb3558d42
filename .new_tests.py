

# =========================================================================== Tables, the library and the runner protocol


def run_main(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """``nrvna.main(args)`` in-process: (exit code, stdout, stderr); argparse's exit 2 too."""
    try:
        code = nrvna.main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_readme_s_tables_are_generated_from_nrvna_s_tables() -> None:
    done = subprocess.run([sys.executable, str(HERE / "scripts" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    for name, table in nrvna.markdown_tables().items():
        assert table in readme, name
    for setting in nrvna.SETTINGS.values():
        assert f"`{setting.env}`" in readme
    for name in nrvna.PARAMS:
        assert f"| `{name}` |" in readme


def test_every_job_parameter_with_a_flag_is_a_submit_flag_and_reaches_params_json(ws: str, capsys: Any) -> None:
    code, out, _ = run_main(["submit", "--help"], capsys)
    assert code == 0
    flagged = {name: p.flag for name, p in nrvna.PARAMS.items() if p.flag}
    assert {"max_tokens", "temperature", "top_k", "stop", "presence_penalty", "frequency_penalty", "tag"} <= set(flagged)
    for flag in flagged.values():
        assert flag in out
    code, out, err = run_main(["submit", ws, "hello", "--top-k", "5", "--stop", "a", "--stop", "bb",
                               "--presence-penalty", "0.5", "--frequency-penalty", "-1", "--ignore-eos",
                               "--min-p", "0.2", "--tag", "t1", "--raw"], capsys)
    assert code == 0, err
    job = Flow(ws).get(out.strip())
    assert job is not None
    assert job.params == {"top_k": 5, "stop": ["a", "bb"], "presence_penalty": 0.5, "frequency_penalty": -1.0,
                          "ignore_eos": True, "min_p": 0.2, "tag": "t1", "raw": True}
    code, _, err = run_main(["submit", ws, "hello", "--presence-penalty", "3"], capsys)
    assert code == 2 and "presence_penalty" in err and "out of range" in err


def test_a_job_s_parameter_comes_from_the_job_then_the_daemon_s_setting_then_the_table() -> None:
    config = nrvna.Config(temperature=0.3, max_tokens=77)
    assert nrvna.job_param({"temperature": 0.9}, "temperature", config) == 0.9
    assert nrvna.job_param({}, "temperature", config) == 0.3
    assert nrvna.job_param({}, "max_tokens", config) == 77
    assert nrvna.job_param({}, "presence_penalty", config) == 0.0  # no setting: the table's default
    assert nrvna.job_param({}, "raw") is False
    assert nrvna.Config.from_env({"NRVNA_PREDICT": "12", "NRVNA_TEMP": "0"}).as_dict()["max_tokens"] == 12
    # every setting named like a parameter is that parameter's default, with the same limits
    for name in set(nrvna.SETTINGS) & set(nrvna.PARAMS):
        setting, param = nrvna.SETTINGS[name], nrvna.PARAMS[name]
        assert (setting.kind, setting.low, setting.high) == (param.kind, param.low, param.high), name


def test_openai_body_fields_map_through_the_parameter_table() -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.4,
                     "frequency_penalty": 0.1, "max_tokens": 9, "max_completion_tokens": 7, "stop": "END",
                     "model": "gpt-4o-mini"}}
    notes: list[str] = []
    [entry] = nrvna.parse_batch((json.dumps(line) + "\n").encode(), notes=notes)
    assert entry.params["presence_penalty"] == 0.4 and entry.params["frequency_penalty"] == 0.1
    assert entry.params["max_tokens"] == 7  # max_completion_tokens wins, as OpenAI documents
    assert entry.params["stop"] == ["END"] and entry.params["endpoint"] == "/v1/chat/completions"
    assert notes and "ignored" in notes[0]
    line["body"]["logit_bias"] = {}
    with pytest.raises(nrvna.InvalidInput, match="body field 'logit_bias' is not supported"):
        nrvna.parse_batch((json.dumps(line) + "\n").encode())
    with pytest.raises(nrvna.InvalidInput, match="unknown field 'endpoint'"):
        nrvna.parse_batch(b'{"prompt": "x", "endpoint": "/v1/completions"}\n')


def test_export_formats_come_from_one_table_and_an_unknown_one_is_an_error(ws: str, tmp_path: Path,
                                                                          capsys: Any) -> None:
    job_id = submit(ws, "hi")
    with serving(ws, echo):
        wait_all(ws, [job_id])
    code, out, _ = run_main(["export", "--help"], capsys)
    for name in nrvna.EXPORT_FORMATS:
        assert name in out
    code, _, err = run_main(["export", ws, "--format", "yaml"], capsys)
    assert code == 2 and "invalid choice" in err
    with pytest.raises(nrvna.InvalidInput, match="unknown export format"):
        Flow(ws).export(io.StringIO(), format="yaml")
    job = Flow(ws).get(job_id)
    with pytest.raises(nrvna.InvalidInput, match="no JSON record"):
        nrvna.export_record(job, "text")
    for name, form in nrvna.EXPORT_FORMATS.items():
        stream = io.StringIO()
        assert Flow(ws).export(stream, [job_id], format=name) == (1, 0)
        assert stream.getvalue() == form.line(job)


def test_the_library_does_what_the_cli_does(ws: str, tmp_path: Path) -> None:
    """Every command is one library call: a batch file with resume, wait, follow, export,
    cancel, retry, clean, daemon_info and stop_daemon."""
    path = write(tmp_path / "b.jsonl", jsonl([{"custom_id": f"q{i}", "prompt": f"p{i}"} for i in range(5)]))
    work, flow = Work(ws), Flow(ws)
    seen: list[str] = []
    ids = work.submit_file(path, tag="lib", on_ids=seen.extend, max_tokens=3)
    assert seen == ids and len(set(ids)) == 5
    assert all(flow.get(i).params["max_tokens"] == 3 for i in ids)
    notes: list[str] = []
    assert work.submit_file(path, tag="lib", notes=notes) == ids  # resumed: nothing queued twice
    assert "5 of 5 lines are already queued" in notes[0] and flow.counts()["queued"] == 5
    with pytest.raises(nrvna.InvalidInput, match="line 1"):
        work.submit_file(b'{"prompt": ""}\n', jsonl=True)
    assert all(s is Status.Queued for s in flow.wait_all(tag="lib", timeout=0).values())
    cancelled = nrvna.cancel_jobs(ws, [ids[0]])
    assert cancelled == [(ids[0], "cancelled", f"job {ids[0]} cancelled")]
    with pytest.raises(nrvna.InvalidInput):
        nrvna.cancel_jobs(ws)
    with serving(ws, words):
        states = flow.wait_all(tag="lib", timeout=30)
        assert list(states) == ids
        assert [s.value for s in states.values()] == ["failed"] + ["done"] * 4
        assert b"".join(flow.follow(ids[1])) == flow.result_bytes(ids[1])
        assert flow.status(ids[1]) is Status.Done
        assert nrvna.daemon_info(ws)["pid"] == os.getpid()  # the in-process daemon holds the lock
        assert [r[1] for r in nrvna.retry_jobs(ws, failed=True)] == ["queued"]
        assert flow.wait_all([ids[0]], timeout=30) == {ids[0]: Status.Done}
    out, errors = tmp_path / "out.jsonl", io.StringIO()
    assert flow.export(str(out), tag="lib", format="openai", errors=errors) == (5, 0)
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == [f"q{i}" for i in range(5)]
    assert nrvna.clean_jobs(ws, 0, dry_run=True) == ids
    with pytest.raises(nrvna.NoSuchJob):
        nrvna.daemon_info(ws)
    with pytest.raises(nrvna.NoSuchJob):
        nrvna.stop_daemon(ws)
    with pytest.raises(nrvna.NoSuchJob, match="no job nope"):
        flow.select(["nope"])
    with pytest.raises(nrvna.InvalidInput, match="does not exist"):
        Flow(str(tmp_path / "nowhere")).select()


def test_a_runner_is_a_runner_or_a_function_and_sessions_have_working_defaults(ws: str) -> None:
    with pytest.raises(TypeError, match="Runner or a function"):
        Server(None, ws, 1, runner=object())
    session = nrvna.Session()
    for call in (session.free, session.active, session.step):
        with pytest.raises(NotImplementedError):
            call()
    assert session.idle() is None and session.set_threads(4) is None and session.close() is None
    with pytest.raises(NotImplementedError):
        nrvna.Runner().session(0, nrvna.Config())
    assert isinstance(Server(None, ws, 1, runner=echo).runner, nrvna.FunctionRunner)


def test_client_code_never_calls_a_daemon_class_s_private_methods() -> None:
    """The client and the CLI use the job-directory layer's public helpers; the daemon's
    classes keep their private methods to themselves."""
    import ast

    tree = ast.parse((HERE / "nrvna.py").read_text(encoding="utf-8"))
    daemon_classes = {"Processor", "Server", "Scanner", "Pool", "LlamaSession", "LlamaRunner"}
    offenders = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in daemon_classes:
            continue
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and sub.attr.startswith("_") and not sub.attr.startswith("__")
                    and isinstance(sub.value, ast.Name) and sub.value.id != "self"
                    and (sub.value.id in daemon_classes or sub.value.id in ("flow", "server", "processor"))):
                offenders.append(f"{getattr(node, 'name', '?')}: {sub.value.id}.{sub.attr}")
    assert offenders == []
