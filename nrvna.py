#!/usr/bin/env python3
"""nrvna: a durable, asynchronous job queue for local LLM inference.

A job is a directory and its location is its state. Atomic ``rename()`` moves it
``input/writing/ -> input/ready/ -> processing/ -> output/ | failed/``. One daemon loads a
GGUF model once (llama.cpp through llama-cpp-python) and works the queue with N worker
threads, each owning its own llama context. Clients need nothing but this file and the
filesystem: ``from nrvna import Work, Flow`` works on a bare Python.

    python nrvna.py daemon model.gguf ws
    id=$(python nrvna.py submit ws "What is AI?")
    python nrvna.py get ws "$id" --wait

Contents. Two levels of numbered banners, in dependency order: a section or sub-section uses only
what is above it. Each banner has a lead (what it owns, its invariant, which threads call in). Inside
a sub-section: constants, record types, functions and helper classes, the tables made of them, the
main class last. No sub-section (or section without them) is over 800 lines; a test checks all this.

1. Errors and exit codes            NrvnaError and its subclasses, JobError, EXIT_CODES, FAILURE_CODES
2. Settings                         SETTINGS, KV_TYPES, Config, setting_default, HOOK_VARIABLES, thinking_tags
3. Logging                          configure_logging, log (log.limited), OS thread names
4. File primitives                  write_file, read_file, fsync_dir, move (never replaces)
5. Structured output
   5.1 Numbers                      _BOUNDS, number_rule, _fraction_rule, _multiple_of, _multiples
   5.2 JSON strings                 _spans*, _json_char_gbnf, _gbnf_literal
   5.3 Patterns                     _pattern_shape, _positions, _sweep, _Regex
   5.4 Formats and types            SCHEMA_FORMATS, string_rule, type_choices
   5.5 Grammar work                 grammar_code_points, GrammarVocab, GrammarShape
   5.6 GBNF grammars                check_grammar, _GbnfParser
   5.7 JSON schemas                 check_json_schema, _schema_branch (shared with 11.2), _SchemaCheck
   5.8 Tool calls                   ToolFormat, tool_call_schema, tool_grammar, generic_messages, read_tool_calls
6. Job parameters                   Param, PARAMS, ENDPOINTS, validate_params, job_param, check_prompt,
                                      EFFORT_BUDGETS, thinking_budget, tool_answers
7. Workspace and job directories
   7.1 Layout, locks and the daemons' records
                                    the layout's names, job_path, shallow, parse_meta, read_record, WorkspaceLock, hold_job,
                                    hold_orphan, register_daemon, DAEMON_RECORD_FIELDS, daemon_records
   7.2 IDs, states and meta.json    META_FIELDS, generate_id, order_key, Status, locate_job, parent_unfinished,
                                      job_meta, read_meta
   7.3 A job's history              mark_failed, job_history, record_event, owe_hooks, move_job
   7.4 Routes and model files       Route, read_route, gguf_files, model_matches, resolve_model
   7.5 Idempotency keys and tags    dedupe_key, key_job, _KeyHolder, tag_shard, claim_tag_shard, tag_members
   7.6 Reading a job                Job, _read_choices, continued_turns, CONVERSATION_TURNS, parent_conversation,
                                      _DirWatch
   7.7 Saved states on disk         STATES, StateHead, state_owner, state_name, state_temp_name, state_buffer,
                                      seal_state, inspect_state, read_state_head, map_state, state_whole,
                                      read_state, remove_states_of
8. Batch files and export
   8.1 Batch files                  BatchEntry, read_batch, parse_batch, parse_records (templates), shard_of
   8.2 Export and merge             REQUEST_KEY, request_digest, job_vectors, export_record, read_part,
                                      merge_parts, EXPORT_FORMATS, _ExportTarget
9. Client
   9.1 Reading: Flow                bulk_states, Flow
   9.2 Submitting: Work             check_model_names, waiting_for_model, _Keys, Work
   9.3 Events                       iter_events
   9.4 Cancel, retry, clean         cancel_job(s), retry_job(s), clean_jobs
   9.5 Daemons: info and stop       daemon_info, stop_daemon (_proven_daemon)
   9.6 Metrics                      METRICS, RATE_FINISHES, _MetricsCache, metrics_text (Prometheus' text format),
                                      recent_finishes, finish_rate (the ETA's rate)
10. Runner protocol                 Runner, Session, RunningJob, Outcome, FunctionRunner
11. llama.cpp engine
   11.1 llama.cpp and GGUF files    _import_llama, _install_llama_logging, _kv_params, _new_context (a context
                                      and its buffers), check_gguf, _GgufHeader
   11.2 Grammar conversion          schema_to_grammar, _CallThread (the Grammar and Wide threads), _Conversion
   11.3 Sampling                    _Penalties, _SamplingScratch, _likeliest, _GrammarTemplates, _JobSampler
   11.4 Sequences and choices       _ThinkRouter (thinking apart), _Thinking (a model's block), _Choices (n),
                                      _Sequence
   11.5 Embeddings                  _Embedding, _Embedder
   11.6 Saved states                state_fingerprint, _shared_prefix, _CheckThread, StateStore (the Saver thread)
   11.7 Continuous batching         _PrefixCache, _Batch, _Preemption, LlamaSession
   11.8 The runner                  HOST_CACHES, FALLBACK_TEMPLATE, model_memory, memory_line, tool_turns, grammar_key,
                                      LlamaRunner
12. Daemon
   12.1 The queue: Pool and Scanner
                                    _Place, _QueueHead, Scanner, Pool
   12.2 Claims and finishes: Processor
                                    _Claim, _HandBacks (failed finishes, a full disk), Processor
   12.3 Recovery and hooks          _Recovery (orphans, staging), Hooks
   12.4 Models                      _ServedModel, check_memory_budget, _LoadFailure, _ModelSwitch, _Models
   12.5 Daemons side by side, and the watch
                                    _clash, _hooks_clash, _Registry, _Watcher (cancels, timeouts, dead daemons)
   12.6 Server                      _WorkerLoads, _claim_later, _with_states_folder, Server
13. Served API
   13.1 HTTP                        bounds, parse_head, ApiError, ApiReply, ApiCall, api_key_matches,
                                      read_multipart, multipart_field, file_chunks
   13.2 Files                       API_FILES, FILE_PURPOSES, api_token, api_temp_name, ApiFiles
   13.3 Batches                     BATCHES, BATCH_STEPS, BATCH_RECORD_FIELDS, batch_status, batch_file_id,
                                      check_batch_request, batch_errors, ApiBatches, BatchLifecycle (the Batches thread)
   13.4 Endpoints                   SYNC_PRIORITY, FAILURE_STATUS, submit_request, answer_request, RequestStream
                                      (server-sent events), _chat_completions, _completions, _embeddings
   13.5 The server                  API_ROUTES (one handler per route), _Connection, _Reader (the Api-IO thread),
                                      ApiServer
14. CLI
   14.1 Commands                    markdown_tables (the manual's tables), _DaemonWatch, one _cmd_* per command
   14.2 Arguments and main          one _*_arguments per command, COMMANDS, main()

API (``__all__``; docs/library.md documents each name, and names every other one not
``_``-prefixed as internal: such names may change in any release):

    Work               submits jobs: submit, publish, publish_batch, submit_file
    SubmitResult       what Work.submit returns: (ok, id, message), errors as values
    Flow               reads jobs: status, get, wait, follow, wait_all, select, counts, lanes, export
    Status             a job's state: Queued, Running, Done, Failed, Missing
    Job                what Flow.get returns: id, status, prompt, result, error, meta, params, logprobs, choices, reasoning
    iter_events        jobs' changes of state as event dicts, as `nrvna events` prints them
    bulk_states        many jobs' states at once, one listing per state directory
    cancel_job         `nrvna cancel` for one job
    cancel_jobs        `nrvna cancel` for IDs or a tag
    retry_job          `nrvna retry` for one job
    retry_jobs         `nrvna retry` for IDs, a tag or every failed job
    clean_jobs         `nrvna clean`: remove finished jobs older than a bound
    daemon_info        `nrvna status --daemon`: the running daemons' records
    stop_daemon        `nrvna stop`: the stopped daemons' pids
    metrics_text       `nrvna metrics`: the workspace's figures in Prometheus' text format
    BatchEntry         one batch line: (line, prompt, params)
    parse_batch        a whole batch file (bytes) checked into BatchEntry values
    read_batch         a batch file's bytes from a binary stream, each line bounded
    batch_line_limit   the longest batch line read_batch takes
    parse_records      a data file's records (JSONL or CSV) filling a template, as BatchEntry values
    export_record      one export line (a dict) for a Job
    job_vectors        an embed job's vectors
    ExportFormat       an export format's row of EXPORT_FORMATS
    EXPORT_FORMATS     the export formats: jsonl, openai, text, f32
    Config             the daemon's settings (Config.from_env(): the NRVNA_* variables)
    SETTINGS           every NRVNA_* variable: its type, default, range and help
    Param              a job parameter's row of PARAMS
    PARAMS             every job parameter: its check, flag, OpenAI field and help
    validate_params    job parameters checked as publish checks them
    check_json_schema  a JSON schema checked as submit checks it (InvalidInput naming the keyword)
    check_grammar      a GBNF grammar checked as submit checks it (InvalidInput)
    NrvnaError         the base of every error nrvna raises; exit_code is the CLI's
    InvalidInput       a bad prompt, ID, parameter, batch line or argument (exit 2)
    ConfigError        an invalid NRVNA_* value or daemon option (an InvalidInput)
    NoSuchJob          no job with that ID (exit 3)
    NotFinished        the job is queued or running, or a wait ran out (exit 4)
    KeyHeld            a live submit holds the idempotency key past NRVNA_KEY_WAIT (a NotFinished)
    WorkspaceError     the workspace cannot be used
    ModelError         the model cannot be found or loaded
    NotDurable         the job was published but the fsync confirming it failed (job_id has its ID)
    JobError           raised in a runner: fail one job with a code and a message
    Interrupted        raised in a runner: the job stopped for a shutdown and goes back to the queue
    EXIT_CODES         the CLI's exit codes and what each means
    FAILURE_CODES      the codes a failed job carries and what each means
    Runner             the runner protocol: one Session per worker
    Session            a worker's jobs: start, step, drop, free, active, idle, close
    RunningJob         what a runner sees of a job: id, prompt, params, emit, stop, interrupt
    Outcome            how a job ended: text, finish reason, token counts, error, logprobs, choices, reasoning
    FunctionRunner     a function fn(job) -> str as a Runner
    LlamaRunner        llama.cpp's runner, the daemon's default (needs llama-cpp-python)
    Server             the daemon in-process: start, serve_forever, shutdown (a context manager)
    main               the command line: main(argv) -> exit code

Threads (who touches shared state, and what makes it safe; each daemon and engine class repeats
its part in a "Threads:" line), as THREAD -> CLASS: the shared state => the lock or rule:

    Main -> Server: starts, serves, stops; _use (sessions, thread budget) at start; stranded; _signalled
        (set by the signal handler) => before the other threads start and after they are joined; the
        signal handler only sets one field (takes no lock)
    Main -> _Registry: lock file and record: register, release, dead() at start; write at a drain
        (Server._say_stranded) => register/release before threads start / after join; write and keep under
        _Registry._lock (the record's temp name is fixed)
    Main -> _Recovery: processing/ orphans at start, run_last_chances (claims, runs, finishes alone) =>
        under the WorkspaceLock; before the workers start
    Main -> Scanner: wake() (a pipe); scan() at a drain check => Pool locks itself; scans is only compared
        with 0, and Main scans only after it is not
    Main -> Hooks: prepare, start, idle, stop (closes _held) => _lock for _in_flight; stop joins the hook
        threads before closing _held
    Main -> _Models: constructor, start (activates the first model that loads), peers (start), describe
        (register), close (shutdown) => before the threads start / after they are joined; routing state
        under _Models._lock
    Scanner -> Pool: push: _heaps, _known, elsewhere, _taken => Pool._cond's lock; route is called under
        it, _on_queued outside it
    Scanner -> _Models: queue_of (route cache, failed, *_elsewhere) => _Models._lock, taken under the
        Pool's lock (order: Pool, then _Models; nothing under _Models._lock takes another lock)
    Scanner -> Server / _WorkerLoads: _queued -> _outranked: reads the tops, preempts sessions =>
        _WorkerLoads._lock (held for the list operation only); LlamaSession.preempt() sets a flag
    Scanner -> _ModelSwitch: wake => a threading.Event
    Worker-N -> Pool: get, done, retry_later, favor, top_priority, len, active => Pool._cond's lock
    Worker-N -> _WorkerLoads: its own load and top (write); every worker's (read) => _WorkerLoads._lock
    Worker-N -> Processor: claim, finish, requeue of the jobs it holds; _claims => a job is held by one
        thread (the Pool gives an ID out once; the claim rename and hold_job make it this daemon's);
        _claims under _claims_lock; a claim's dir_fd under _Claim.lock
    Worker-N -> _HandBacks: failed-finish counts, room waited for => _HandBacks._lock
    Worker-N -> Server: _running, _stats, _recent; _sessions[index] => _stats_lock; _sessions changes only
        while every worker is parked (_ModelSwitch.park)
    Worker-N -> _Models: reads active, served[active].name at a claim => read only while the Pool has an
        active queue; a switch clears it and waits for every worker to park before activate
    Worker-N -> _ModelSwitch: park, leave; wake => _ModelSwitch._cond; wake is an Event
    Worker-N, Finisher -> Hooks: poke => a threading.Event
    Finisher -> Processor, _HandBacks, Server, Pool: _end of jobs a worker handed it (finish, stats,
        done/retry_later) => the job is the Finisher's once queued (a queue.SimpleQueue); the locks as for
        the workers
    Models -> _ModelSwitch: _parked, _generation, workers; failure => _cond (workers read without it: one
        int); failure read by Main only once stopped
    Models -> _Models: activate, load_ahead, load_failed, retries, turn, failures;
        served[i].runner/sessions, active, since, loads, early_failed => routing state (failed, each
        _LoadFailure, route cache, *_elsewhere) under _Models._lock; the loaded models, active, since,
        loads, early_failed are changed by the Models thread alone
    Models -> Pool: heads, running, set_active, take_queue, set_aside, reroute => Pool._cond's lock
        (reroute calls _Models.retries under it)
    Models -> _WorkerLoads: top() (a reason to switch) => _WorkerLoads._lock
    Models -> Server: _use (sessions, thread budget) while every worker is parked; _fail_unloadable
        (claims and ends a given-up model's jobs) => the switch protocol (park); ending as the workers do
    Watcher -> _Watcher: _next_* timers => the Watcher's alone
    Watcher -> Processor: cancel_requested, flush_partial (a running job's emitted, its partial.txt);
        daemon (written) => _claims_lock, then the claim's lock (not once closed); emitted is a deque
        (append/popleft); daemon is one string replaced whole
    Watcher -> RunningJob: interrupt (cancel, timeout) => one attribute, set once, read by the worker
        between tokens
    Watcher -> _Recovery: orphans (a daemon died, every ORPHAN_SECONDS) => the WorkspaceLock; a job any
        live daemon (this one included) holds is left alone (hold_orphan)
    Watcher -> _Registry: keep, dead, write => _Registry._lock around write and the rename in keep
    Watcher -> Pool, _Models: forget_gone, reroute(peers) => Pool's lock, then _Models._lock
    Watcher -> Server: _running_jobs, status (stats, describe) => _stats_lock
    Watcher -> _Models: describe: served[i].runner/sessions and active read as they are, with no lock (the
        Models thread changes them: a record a switch behind at worst); each runner's memory (see
        model_memory); the routing state (failed) under _Models._lock
    Watcher, loader -> LlamaRunner (memory, model_memory): _sessions (each with its _ContextSize),
        weights_mib => _lock for the list; only plain numbers stated when the model and each context were
        made (a session's _Embedder.buffers too), never the model or a context through llama.cpp: the
        Models thread may be freeing them (close empties _sessions under _lock first)
    Hooks -> Hooks: lists hooks/done/, submits tasks; _held (hooks/' lock) => _lock for _in_flight and
        _errors (read as a copy); _held is the Hooks thread's until Main's stop joins it
    Hook-N -> Hooks: runs tasks: _in_flight, _procs, _unfinished, _errors => _lock; tasks come through a
        queue.Queue, each task in flight once
    loader (_Models: Main at the start, the Models thread at a switch or a load ahead) -> LlamaRunner: the model,
        its vocabulary, the tables made at load (eog/control tokens, pooling, chat formatter); its
        sessions => made, with its sessions, and closed while no worker uses it; read only afterwards
        (llama.cpp's model may be shared by contexts on several threads)
    Worker-N -> LlamaRunner: _grammars (LRU of made grammars), _converting, _converter, _grammar_vocab,
        conversions => _grammars_lock, never held while a grammar is made
    Worker-N -> LlamaRunner: _pieces (token -> bytes cache) => no lock: a token's bytes are the same
        whoever stores them, and one dict get or set is atomic
    loader -> LlamaRunner: session, close: _sessions => _lock (model_memory reads them: above)
    Worker-N, Saver -> StateStore: _index, _skipped, _pending, counts (find, restore, wants, save on the worker;
        _write, evict on the Saver) => _lock; a state file is read or written outside it (each is written whole
        under a temporary name first); the loader's close joins the Saver. A restore's crc is checked on a
        StateCheck thread of its own, joined by the worker before it closes the mapping
    Worker-N, Watcher -> Pool (waiting: children whose parent has not ended): released by a finish (the
        worker or Finisher), release_finished by the Watcher => Pool._cond's lock
    Worker-N, Wide -> LlamaRunner (decode_wide, wait_wide): the Wide thread's OpenMP team => _wide_lock:
        one borrower's decode at a time; a plain decode waits for it to end
    Grammar -> LlamaRunner (_convert), _Conversion: a conversion's found / error => written before its
        done Event is set; the waiting workers read them only after
    any -> _CallThread (Grammar, Wide): its call queue => a queue.SimpleQueue (thread-safe); each call's result in
        its own box, set before its Event
    Worker-N -> LlamaSession and what it holds: _Sequence, _Choices, _PrefixCache, _Batch,
        _SamplingScratch, _GrammarTemplates, _JobSampler, _Penalties, _Embedder, _Embedding: its llama
        context(s), KV cells, batch, samplers, slots => one worker's only (llama.cpp's rule: a context is
        never shared between threads), but: made (LlamaRunner.session) and closed (LlamaRunner.close) by
        the loader while no worker uses it (a switch parks every worker first); preempt (below); grammars
        handed over by the Grammar thread (_Conversion, above); its _Embedder.buffers read by the
        Watcher (model_memory: a dict made whole before the session's embedder is set, then never changed)
    Scanner, Worker-N (Server._outranked) -> _Preemption (LlamaSession.preempt): the one-byte abort flag
        => no lock: one byte written and read; a request that lands after the worker's clear cuts its next
        step, which the sequences take again (a cut step changes nothing)
    Worker-N -> GrammarShape (a worker's fork, via _GrammarTemplates): its memos (advanced, splits,
        vocab_costs, asked) => confined: each worker counts with its own fork; the runner's shape is
        checked on the thread that makes it, then never counted with again (its elements and start, shared
        by the forks, never change)
    Worker-N -> GrammarVocab: decoded (code points per partial character) => GrammarVocab.lock: one
        decodes, the others wait for that
    any -> _Log (log.limited): _LIMITED => _LIMITED_LOCK
    any (a client's: a server's handlers) -> metrics_text, _MetricsCache: _METRICS_CACHES (one cache a workspace)
        => _METRICS_LOCK around each lookup and removal; a cache's sums => _MetricsCache.lock, held for a whole call
    Main, Worker-N -> _checked (a schema or tools checked at submit, in parse_batch, at each claim):
        _CHECKED => _CHECKED_LOCK around each read and each write (with its eviction), never held while a
        check runs: two threads may check one key at once, and find the same
    Main, Worker-N -> _python_class: _python_classes => no lock: filled whole by one update (threads that
        race compute the same)
    Main, loader -> gguf_strings: _gguf_headers => no lock: one get, one set or clear, each atomic (a
        header two threads race for is read twice)
    any (llama.cpp's log callback), loader, Worker-N -> _install_llama_logging, _new_context,
        _llama_log_reason, _GrammarTemplates, LlamaRunner: _llama_log_tail => no lock: the callback appends
        and cuts it to 5 lines, a call whose failure it explains clears it first, _llama_log_reason reads
        one slice (at worst another thread's line is the reason given); _buffer_sizes => by thread: each
        thread adds, fills (its callback) and removes its own entry
    Api-IO -> _Reader: the connections whose request is being read => Api-IO's alone; Api-N gives a kept-alive
        one back through a queue.SimpleQueue and a pipe
    Api-IO, Api-N -> ApiServer: requests => a queue.Queue; _threads, _idle => _lock; _stop_asked => one
        attribute (a signal handler sets it)
    Api-N -> ApiFiles: a file's folder => written whole under api/tmp/, then published or put aside by one rename
    Api-N -> RequestStream, _RequestWatch: one request's job, followed => the request's own thread alone; the
        job's files change only by the daemon's renames and appends, read with Flow's checked readers
    Api-N, Batches -> ApiBatches: a batch's record => rewritten whole (temporary name, fsync, rename) under a
        flock on api/batches/, held for the read-modify-write only; its jobs and files as any client's
    Batches -> BatchLifecycle: ended, the lock's descriptor => its own; every step of every batch => the flock on
        api/batches/lifecycle.lock: one process of a workspace takes steps (a second server's thread waits)
    Main -> BatchLifecycle: start, stop (ApiServer's) => stop sets an Event and joins the thread before closing the lock
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    # client
    "Work", "SubmitResult", "Flow", "Status", "Job", "iter_events", "bulk_states",
    "cancel_job", "cancel_jobs", "retry_job", "retry_jobs", "clean_jobs", "daemon_info", "stop_daemon", "metrics_text",
    # batch files and export
    "BatchEntry", "parse_batch", "read_batch", "batch_line_limit", "parse_records", "export_record", "job_vectors",
    "ExportFormat", "EXPORT_FORMATS",
    # settings and job parameters
    "Config", "SETTINGS", "Param", "PARAMS", "validate_params", "check_json_schema", "check_grammar",
    # errors
    "NrvnaError", "InvalidInput", "ConfigError", "NoSuchJob", "NotFinished", "KeyHeld", "WorkspaceError",
    "ModelError", "NotDurable", "JobError", "Interrupted", "EXIT_CODES", "FAILURE_CODES",
    # runners and the daemon
    "Runner", "Session", "RunningJob", "Outcome", "FunctionRunner", "LlamaRunner", "Server",
    "main",
]

import codecs
import contextlib
import enum
import errno
import functools
import heapq
import itertools
import math
import os
import re
import stat
import sys
import threading
import time
from collections import Counter, deque, namedtuple

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations are strings at run time: importing typing costs 4 ms a start
    from pathlib import Path
    from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

_INF = float("inf")  # JSON from Python's json module may hold Infinity

# Heavy or daemon-only modules (json, logging, ctypes, argparse, llama_cpp) are imported
# where used: `nrvna submit` must start about as fast as `python -c pass`.


##############################################################################
# 1. Errors and exit codes
##############################################################################
# Owns every exception nrvna raises and the two code tables, EXIT_CODES and FAILURE_CODES.
# Invariant: an error reaches the CLI as one line and its table's exit code, never a traceback.
# Stateless: any thread, any process.


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MISSING, EXIT_UNFINISHED = 0, 1, 2, 3, 4
# What the CLI's exit codes mean (--help and the README).
EXIT_CODES = {
    EXIT_OK: "ok; the job is done (wait: all done; cancel: all cancelled)",
    EXIT_FAILED: "the job failed (wait: one failed; cancel: one had finished; retry: a named job is not failed), "
                 "or the daemon could not start or run (model, workspace, lock)",
    EXIT_USAGE: "usage error or invalid input (prompt, ID, parameter, batch line, NRVNA_* value)",
    EXIT_MISSING: "no such job or tag (status --daemon, stop: no daemon running)",
    EXIT_UNFINISHED: "not finished yet: queued or running, a --wait-timeout or wait/stop --timeout ran out, "
                     "export left unfinished jobs out, submit: a live submit holding the idempotency key has not "
                     "published its job (NRVNA_KEY_WAIT ran out; nothing queued)",
}

# Why a job failed: the ``code`` in its meta.json (and JobError's), with what it means. `retry
# --code` accepts these alone, its --help lists them, and the README's table comes from here;
# a test finds every code literal in this file and checks it is a row.
FAILURE_CODES = {
    "cancelled": "`nrvna cancel` (a running job keeps its partial text in `partial.txt`)",
    "timeout": "it generated for longer than its `timeout` parameter (partial text kept)",
    "context_overflow": "its prompt does not fit in a sequence's share of the context: `prompt is N tokens; a "
                        "sequence holds M`; an embed job's text is longer than an embedding may be (`input[i] is "
                        "N tokens; an embedding takes at most M`)",
    "unsupported": "the model cannot run this kind of job: a generation job on an embedding model, or an embed "
                   "job on a model without a pooling type (`NRVNA_POOLING`)",
    "bad_request": "the job itself is malformed: no or empty `prompt.txt`, invalid UTF-8, a NUL byte, bad "
                   "`params.json`, a prompt over `NRVNA_MAX_PROMPT_BYTES`, a symlink, FIFO or plain file instead "
                   "of a job directory or prompt, a chat template that fails on it, a grammar llama.cpp refuses, "
                   "a `logit_bias` token outside the vocabulary",
    "grammar_error": "no token of the model's vocabulary can continue the job's grammar, or its next step would "
                     "take llama.cpp past nrvna's grammar work limits (too ambiguous, or too wide: see Guarantees)",
    "crash_ceiling": "the daemon died while running it `NRVNA_MAX_ATTEMPTS` times (the killed attempt's "
                     "`partial.txt` kept)",
    "load_failed": "the model it names (or its kind's) could not be loaded `NRVNA_MAX_LOAD_FAILURES` times by the "
                   "daemon serving it: the error names the file and llama.cpp's reason (`nrvna retry` queues it "
                   "again once the file is fixed)",
    "write_error": "its result could not be written `NRVNA_MAX_WRITE_TRIES` times (an I/O error, a file size "
                   "limit, a result larger than the whole filesystem; a full disk is waited out, never counted): "
                   "the message names the last error; each failed finish handed it back to the queue unchanged",
    "parent_failed": "it continues a job (`parent`) that failed, was cancelled or is gone (cleaned): it did not run; "
                     "`nrvna retry` the parent, then this job. Also when the parent's files cannot make a "
                     "conversation (past its bounds, a loop of parents, turns that are not turns): the message "
                     "names the file",
    "model_error": "`llama_decode` itself failed (rare; every job in that batch fails, since they cannot be told "
                   "apart)",
    "runner_error": "the runner raised an unexpected exception (the message names it); the worker lives on",
}


class NrvnaError(Exception):
    """Base of every error nrvna raises; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class InvalidInput(NrvnaError):
    """Bad user input: a prompt, an ID, a parameter, an argument."""

    exit_code = 2


class ConfigError(InvalidInput):
    """An invalid NRVNA_* variable or daemon option."""


class NoSuchJob(NrvnaError):
    """No job with that ID exists in the workspace."""

    exit_code = 3


class NotFinished(NrvnaError):
    """The job is still queued or running (or a wait timed out)."""

    exit_code = 4


class KeyHeld(NotFinished):
    """Another submit, alive, holds the idempotency key and has not published its job yet
    (NRVNA_KEY_WAIT ran out): nothing was queued."""


class WorkspaceError(NrvnaError):
    """The workspace cannot be used (not a directory, not writable, locked)."""


class ModelError(NrvnaError):
    """The model cannot be found or loaded, or a context cannot be created."""


class NotDurable(NrvnaError):
    """The job was published but the fsync confirming it failed: it may not survive power loss."""

    def __init__(self, job_id: str, cause: OSError) -> None:
        super().__init__(f"job {job_id} is queued but not confirmed durable: {_os_error(cause)}")
        self.job_id = job_id


class JobError(Exception):
    """Raised inside a runner to fail one job with a short code (a key of FAILURE_CODES) and a
    clear message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Interrupted(Exception):
    """Raised by a runner that stopped a job because the daemon is shutting down."""


def _os_error(err: OSError) -> str:
    return err.strerror or str(err) if isinstance(err, OSError) else str(err)


##############################################################################
# 2. Settings: one table (SETTINGS) drives the NRVNA_* variables, the daemon's flags, --help and the docs
##############################################################################
# Owns SETTINGS and Config. Invariant: a value is checked where it is read (Config.from_env, a
# daemon flag) and a Config never changes after. Read by every thread, written by none.


LOG_LEVELS = ("error", "warn", "info", "debug", "trace")
POOLINGS = ("model", "mean", "cls", "last", "none")  # llama.cpp's pooling types, by name
# The KV cache's element types (NRVNA_KV_TYPE): ggml's type number and bytes per value (a block's
# bytes over its 32 values for the quantized ones). llama.cpp reads a quantized V cache only in
# its flash-attention kernel, so a quantized type turns flash attention on (_kv_params, 11.1).
KV_TYPES: dict[str, tuple[int, float]] = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}  # a size setting's units (1024-based)
_MIB = 1 << 20


# What a hook's environment holds: variable -> (the settings whose hooks get it, meaning). The
# hooks' environments, the daemon's --help and the manual's table come from here.
HOOK_VARIABLES: dict[str, tuple[tuple[str, ...], str]] = {
    "NRVNA_WORKSPACE": (("on_done", "on_batch_done"), "the workspace, as an absolute path"),
    "NRVNA_JOB_ID": (("on_done",), "the job's ID"),
    "NRVNA_STATUS": (("on_done",), "`done` or `failed`"),
    "NRVNA_CODE": (("on_done",), "why it failed (its failure code); empty when done"),
    "NRVNA_CUSTOM_ID": (("on_done",), "its custom_id; empty when none"),
    "NRVNA_TAG": (("on_done", "on_batch_done"), "its tag (the batch's, for --on-batch-done); empty when none"),
    "NRVNA_JOBS": (("on_batch_done",), "jobs ever submitted with the tag"),
    "NRVNA_DONE": (("on_batch_done",), "of those, how many are done"),
    "NRVNA_FAILED": (("on_batch_done",), "of those, how many failed"),
}


# A setting's variable, type, default, range (low, high: a number's), help; a str setting's
# choices (None: any text); the daemon's flags that set it; its default as the docs state it
# where the machine decides it; and its own check, where a value needs more than its type's.
_Setting = namedtuple("_Setting", "env kind default low high help choices flags shown check",
                      defaults=(None, (), None, None))


def _default_gpu_layers() -> int:
    return 99 if sys.platform == "darwin" else 0


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _log_level(value: Any) -> str:
    level = str(value).lower()
    return "warn" if level == "warning" else level


def _check_aliases(value: Any) -> str:
    parse_aliases(str(value))  # ConfigError naming the bad entry
    return str(value)


def thinking_tags(value: str) -> Optional[tuple[str, str]]:
    """``NRVNA_THINKING_TAGS`` (``auto``, ``off``, or ``OPEN CLOSE``): a pair of tags, or None for
    ``auto`` and ``off`` (the engine reads those); ConfigError for anything else."""
    words = str(value).split()
    if len(words) == 1 and words[0] in ("auto", "off"):
        return None
    if len(words) != 2 or words[0] == words[1]:
        raise ConfigError(f"NRVNA_THINKING_TAGS: {value!r} is not auto, off, or two different tags OPEN CLOSE")
    return words[0], words[1]


def size_bytes(value: Any) -> int:
    """A size setting (``NRVNA_CACHE_DISK``) in bytes: a number with K, M, G or T (1024-based;
    ``KB``/``KiB`` also read), or with B for bytes; ConfigError otherwise. 0 is none. A number
    with no unit under 1 MiB is refused (``500`` would be 500 bytes, surely not what was meant),
    and so is a size that rounds to 0 bytes (0.5) but 0 itself. The message starts with the
    value, as given: _check_setting puts the flag or variable in its place."""
    spelled = str(value).strip().upper()
    text = spelled.replace("IB", "").replace("B", "")
    number, unit = text.rstrip("KMGT"), text[len(text.rstrip("KMGT")):]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _SIZE_UNITS or not (0 <= amount < 1 << 50) or amount != amount:
        raise ConfigError(f"{value!r} is not a size (a number with K, M, G or T: 512M, 2G; 0 for none)")
    size = int(amount * _SIZE_UNITS[unit])
    if amount and not size:
        raise ConfigError(f"{value!r} rounds to 0 bytes: write 0 for none, or a size with a unit (512M, 2G)")
    if 0 < size < _MIB and not unit and text == spelled:  # no unit at all, not even B
        raise ConfigError(f"{value!r} has no unit, so it would be {size} bytes: add one ({number.strip()}M, "
                          f"{number.strip()}K), or write {number.strip()}B if bytes are meant")
    return size


def _check_size(value: Any) -> str:
    size_bytes(value)  # ConfigError naming the value
    return str(value).strip()


def _check_pending(value: Any) -> str:
    return "auto" if str(value).strip().lower() == "auto" else _check_size(value)


def _check_thinking_tags(value: Any) -> str:
    thinking_tags(str(value))  # ConfigError naming the value
    return " ".join(str(value).split())


def hook_environment(hook: str, values: Mapping[str, str]) -> dict[str, str]:
    """The variables HOOK_VARIABLES gives ``hook`` ("on_done" or "on_batch_done"), from
    ``values`` (which must hold each of them)."""
    return {name: values[name] for name, (hooks, _) in HOOK_VARIABLES.items() if hook in hooks}


def _parse_setting(name: str, raw: str) -> Any:
    setting = SETTINGS[name]
    text = raw.strip()
    if setting.kind is str:
        return _check_setting(name, text)
    try:
        value = setting.kind(text)
    except ValueError:
        raise ConfigError(f"{setting.env}={raw!r} is not {_describe(setting)}") from None
    return _check_setting(name, value)


def _check_setting(name: str, value: Any, flag: Optional[str] = None) -> Any:
    """``value`` checked and normalized, or ConfigError naming ``flag`` where the value came
    from that flag, else the setting's variable."""
    setting = SETTINGS[name]
    given = f"{flag} {value!r}" if flag else f"{setting.env}={value!r}"
    if setting.check is not None:  # the setting's own: normalizes, or raises ConfigError
        try:
            value = setting.check(value)
        except ConfigError as err:  # one that starts with the value alone gets the flag or variable
            if not str(err).startswith(repr(value)):
                raise
            raise ConfigError(given + str(err)[len(repr(value)):]) from None
        given = f"{flag} {value!r}" if flag else f"{setting.env}={value!r}"
    if setting.kind is str:
        if setting.choices is not None and value not in setting.choices:
            raise ConfigError(f"{given} is not one of {', '.join(setting.choices)}")
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{given} is not {_describe(setting)}")
    if setting.kind is int and value != int(value):
        raise ConfigError(f"{given} is not {_describe(setting)}")
    value = setting.kind(value)
    if value != value or not (setting.low <= value <= setting.high):  # NaN fails too
        raise ConfigError(f"{given} is not {_describe(setting)}")
    return value


def _describe(setting: _Setting) -> str:
    kind = "an integer" if setting.kind is int else "a number"
    return f"{kind} from {setting.low} to {setting.high}"


def parse_aliases(text: str) -> dict[str, str]:
    """``NRVNA_MODEL_ALIASES`` (``NAME=MODEL[,NAME=MODEL...]``) as {name: model}."""
    aliases: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        name, sep, model = item.partition("=")
        if item and not (sep and name.strip() and model.strip()):
            raise ConfigError(f"NRVNA_MODEL_ALIASES: {item!r} is not NAME=MODEL")
        if item and name.strip() in aliases:  # the later one won silently
            raise ConfigError(f"NRVNA_MODEL_ALIASES: alias {name.strip()!r} is given twice")
        if item:
            aliases[name.strip()] = model.strip()
    return aliases


def setting_default(name: str) -> Any:
    """A setting's value from the environment (or its default), without building a Config."""
    raw = os.environ.get(SETTINGS[name].env)
    if raw is None or raw.strip() == "":
        return SETTINGS[name].default
    return _parse_setting(name, raw)


# Every NRVNA_* variable: parsing, validation, `--help` and the README's table come from here.
# A setting named like a job parameter (max_tokens, temperature...) is that parameter's default.
SETTINGS: dict[str, _Setting] = {
    "workers": _Setting("NRVNA_WORKERS", int, min(4, cpu_count()), 1, 256, "worker threads, each with its own context",
                         flags=("-w", "--workers"), shown="4, or the cores if fewer"),
    "seqs": _Setting("NRVNA_SEQS", int, 16, 1, 255, "sequences each worker context generates at once (beyond 8, as the jobs' budgets leave room; one more is kept for a higher-priority job)",
                      flags=("-s", "--seqs")),
    "threads": _Setting("NRVNA_THREADS", int, 0, 0, 1024, "CPU threads per context (0 = cores // workers)"),
    "max_ctx": _Setting("NRVNA_MAX_CTX", int, 8192, 64, 1 << 20, "context tokens per worker, shared by its sequences; a job may hold NRVNA_MAX_CTX / min(NRVNA_SEQS, 8) of them (at most the model's training context)"),
    "kv_type": _Setting("NRVNA_KV_TYPE", str, "f16", None, None, "the KV cache's type: f16, q8_0 (0.53x the memory) or q4_0 (0.28x); a quantized cache turns flash attention on, which llama.cpp needs for it (a model or backend without it: exit 2 at start). What each costs in quality: docs/configuration.md",
                         choices=tuple(KV_TYPES), flags=("--kv-type",)),
    "batch": _Setting("NRVNA_BATCH", int, 512, 16, 1 << 16, "tokens per llama_decode call (prefill chunk)"),
    "gpu_layers": _Setting("NRVNA_GPU_LAYERS", int, _default_gpu_layers(), -1, 100000, "layers offloaded to the GPU (-1 all)",
                            shown="0 (99 on macOS)"),
    "gpu": _Setting("NRVNA_GPU", int, -1, -1, 1023, "the GPU this daemon runs on, whole (llama.cpp's main GPU, no split; one daemon per GPU); -1 lets llama.cpp spread the layers over every GPU",
                     flags=("--gpu",)),
    "max_loaded": _Setting("NRVNA_MAX_LOADED", int, 2, 1, 64, "models a daemon serving several keeps loaded at once (the one with nothing queued is evicted first)",
                            flags=("--max-loaded",)),
    "max_load_failures": _Setting("NRVNA_MAX_LOAD_FAILURES", int, 3, 1, 1000, "failed loads of a model (at its turn; tried again after 5 s, then twice as long each time, at most 300 s) after which a daemon serving several models fails its queued jobs with load_failed"),
    "load_ahead": _Setting("NRVNA_LOAD_AHEAD", int, 1, 0, 1, "1 loads the model whose jobs come next while another model runs, into room --max-loaded leaves (it unloads nothing), so its turn starts without a load"),
    "model_turn": _Setting("NRVNA_MODEL_TURN", float, 60.0, 0.0, 86400.0, "seconds a model keeps the daemon while other models' jobs wait; then the longest-waiting model gets its turn (as soon as its running jobs end)",
                            flags=("--model-turn",)),
    "repack": _Setting("NRVNA_REPACK", int, 1, 0, 1, "0 loads weights without AMX/repacked buffers"),
    "mmap": _Setting("NRVNA_MMAP", int, 1, 0, 1, "1 maps model files into memory (loads fast, shares the page cache); 0 reads them into the daemon's memory, so that a model file overwritten in place (cp new.gguf model.gguf) cannot kill the daemon with SIGBUS",
                      flags=("--mmap",)),
    "prefix_cache": _Setting("NRVNA_PREFIX_CACHE", int, 1, 0, 1, "1 shares computed prompt prefixes between a context's jobs (and reads the states NRVNA_CACHE_DISK keeps); 0 computes every prompt whole"),
    "cache_disk": _Setting("NRVNA_CACHE_DISK", str, "2G", None, None, "most bytes of computed contexts (KV states) kept on disk for later jobs, restarts and other daemons, least recently used out first: bytes, or with K, M, G, T; 0 turns the store off. 2G holds about 11 contexts of 8,000 tokens of SmolLM2-135M (23 KB a token), 2 of an 8B model (128 KB a token)",
                           check=_check_size),
    "cache_pending": _Setting("NRVNA_CACHE_PENDING", str, "auto", None, None, "most bytes of computed contexts copied out of the KV cache and waiting for the Saver to write them to NRVNA_CACHE_DISK's store: auto (2 contexts, each at most a job's share of cells: 45 MiB for SmolLM2-135M at the defaults), or a size; a save beyond it is skipped (logged), never waited for",
                              check=_check_pending),
    "max_memory": _Setting("NRVNA_MAX_MEMORY", str, "0", None, None, "a memory budget: a daemon whose models' weights, KV caches and compute buffers (as llama.cpp states them, once the first context is made) and host caches would exceed it exits 2 at start, saying what would fit (0: no budget)",
                           flags=("--max-memory",), check=_check_size),
    "cache_dir": _Setting("NRVNA_CACHE_DIR", str, "", None, None, "where the saved KV states live (empty: the workspace's states/): a faster disk than the workspace's, or one shared by workspaces"),
    "cache_min_tokens": _Setting("NRVNA_CACHE_MIN_TOKENS", int, 512, 16, 1 << 24, "fewest tokens a saved KV state covers: a shorter context is computed again about as fast as its state is written and read"),
    "max_tokens": _Setting("NRVNA_PREDICT", int, 2048, 1, 1 << 20, "max tokens generated per job (default of max_tokens)"),
    "temperature": _Setting("NRVNA_TEMP", float, 0.8, 0.0, 100.0, "sampling temperature, 0 = greedy (default of temperature)"),
    "top_k": _Setting("NRVNA_TOP_K", int, 40, 0, 1 << 20, "top-k sampling, 0 = off (default of top_k)"),
    "top_p": _Setting("NRVNA_TOP_P", float, 0.9, 0.0, 1.0, "top-p sampling, 1 = off (default of top_p)"),
    "min_p": _Setting("NRVNA_MIN_P", float, 0.05, 0.0, 1.0, "min-p sampling, 0 = off (default of min_p)"),
    "repeat_penalty": _Setting("NRVNA_REPEAT_PENALTY", float, 1.1, 0.0, 100.0, "repetition penalty, 1 = off (default of repeat_penalty)"),
    "seed": _Setting("NRVNA_SEED", int, 0, 0, 0xFFFFFFFE, "sampling seed; 0 = random, anything else reproducible (default of seed)"),
    "max_attempts": _Setting("NRVNA_MAX_ATTEMPTS", int, 3, 1, 1000, "daemon deaths a job may cause before it fails"),
    "max_write_tries": _Setting("NRVNA_MAX_WRITE_TRIES", int, 3, 1, 1000, "finishes of a job that may fail to be written (an I/O error, a file size limit, a result larger than the whole filesystem) before it fails with `write_error`; each such finish hands the job back to the queue, uncounted as an attempt, and it is generated again 1 s later. A full disk counts none: its jobs wait, uncounted and not generated again, until there is room"),
    "max_prompt_bytes": _Setting("NRVNA_MAX_PROMPT_BYTES", int, 1 << 20, 1, 1 << 30, "largest prompt accepted"),
    "max_batch_lines": _Setting("NRVNA_MAX_BATCH_LINES", int, 1_000_000, 1, 1 << 31, "most lines a batch file (submit --file) may hold: it is held whole while checked, about 0.8 KB a line"),
    "key_wait": _Setting("NRVNA_KEY_WAIT", float, 60.0, 0.0, 86400.0, "seconds a submit waits for another live submit that holds its idempotency key to publish its job (then exit 4, nothing queued)"),
    "models_dir": _Setting("NRVNA_MODELS_DIR", str, "./models", None, None, "where a model name is looked up"),
    "model_aliases": _Setting("NRVNA_MODEL_ALIASES", str, "", None, None, "other names for models, NAME=MODEL[,NAME=MODEL...]: a job (or the daemon) naming NAME gets MODEL (e.g. gpt-4o-mini=smollm2)",
                             check=_check_aliases),
    "strict_models": _Setting("NRVNA_STRICT_MODELS", int, 0, 0, 1, "1: submit refuses a job whose model matches no known model (exit 2, nothing queued); 0 queues it for the daemon's model, with a note (submit --strict-models)"),
    "pooling": _Setting("NRVNA_POOLING", str, "model", None, None, "how embed jobs pool a text's token vectors into one: model (as its GGUF says), mean, cls, last, or none (no embed jobs)", choices=POOLINGS),
    "embed_normalize": _Setting("NRVNA_EMBED_NORMALIZE", int, 1, 0, 1, "1 returns embeddings L2-normalized (as OpenAI and llama-server do), 0 raw"),
    "thinking_tags": _Setting("NRVNA_THINKING_TAGS", str, "auto", None, None, "a thinking model's block tags: auto (found in its chat template: <think> </think>, [THINK] [/THINK], <seed:think> </seed:think>, <|START_THINKING|> <|END_THINKING|>), off (its thinking is left in the answer), or OPEN CLOSE for another pair",
                              check=_check_thinking_tags),
    "log_level": _Setting("NRVNA_LOG_LEVEL", str, "info", None, None, "error, warn, info, debug or trace", choices=LOG_LEVELS,
                           check=_log_level),
    "on_done": _Setting("NRVNA_ON_DONE", str, "", None, None, "a shell command run for every job that ends, with the job's directory appended as its last argument ($1 of a script)",
                         flags=("--on-done",)),
    "on_batch_done": _Setting("NRVNA_ON_BATCH_DONE", str, "", None, None, "a shell command run once when every job of a tag has ended, with the tag appended as its argument",
                               flags=("--on-batch-done",)),
    "hook_jobs": _Setting("NRVNA_HOOK_JOBS", int, 2, 1, 256, "hooks run at most this many at a time"),
    "api_key": _Setting("NRVNA_API_KEY", str, "", None, None, "the served API's key (`nrvna serve`, `daemon --serve`): every request must then carry `Authorization: Bearer KEY` (else 401); serving an address other than loopback needs one",
                         flags=("--api-key",)),
    "hook_timeout": _Setting("NRVNA_HOOK_TIMEOUT", float, 60.0, 0.1, 86400.0, "seconds a hook may run before it is killed (and logged; not run again)"),
}


class Config:
    """Daemon settings: defaults, overridden by ``NRVNA_*`` variables, then by arguments."""

    __slots__ = (*SETTINGS, "given")

    def __init__(self, **values: Any) -> None:
        # setting -> how it was set, as from_env read it (`--max-memory 500M`, `NRVNA_WORKERS=2`),
        # so that a refusal at start names what the user wrote
        self.given: dict[str, str] = {}
        for name, setting in SETTINGS.items():
            setattr(self, name, setting.default)
        for name, value in values.items():
            if name not in SETTINGS:
                raise TypeError(f"unknown setting {name!r}")
            setattr(self, name, _check_setting(name, value))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Config":
        """Read every ``NRVNA_*`` variable; raise ConfigError naming the first bad one."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        given: dict[str, str] = {}
        for name, setting in SETTINGS.items():
            raw = environ.get(setting.env)
            if raw is not None and raw.strip() != "":
                values[name], given[name] = _parse_setting(name, raw), f"{setting.env}={raw.strip()}"
        for name, value in overrides.items():  # the daemon's flags: an error names the flag given
            if value is not None:
                flags = SETTINGS[name].flags if name in SETTINGS else ()
                values[name] = _check_setting(name, value, flags[-1]) if flags else value
                if flags:
                    given[name] = f"{flags[-1]} {value}"
        config = cls(**values)
        config.given = given
        return config

    def named(self, name: str) -> str:
        """Setting ``name`` as the user gave it (``--max-memory 500M``, ``NRVNA_MAX_MEMORY=500M``),
        or its variable and value where it is the default."""
        return self.given.get(name) or f"{SETTINGS[name].env}={getattr(self, name)}"

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (for logs and tests)."""
        return {name: getattr(self, name) for name in SETTINGS}


##############################################################################
# 3. Logging: `[time] [LEVEL] [Thread] message`, everything on stderr (stdout carries data only)
##############################################################################
# Owns the nrvna logger, its line format and the OS thread names. Invariant: nothing but data
# reaches stdout. Any thread logs (logging's lock orders the lines; log.limited's counts are
# under _LIMITED_LOCK).


TRACE = 5
LOG_REPEAT_SECONDS = 30.0  # at most one line per cause this often (log.limited)
_LIMITED: dict[str, tuple[float, int]] = {}  # cause -> (when its last line was logged, lines left out since)
_LIMITED_LOCK = threading.Lock()


class _Log:
    """The ``nrvna`` logger, imported on first use: client commands never log."""

    def __getattr__(self, name: str) -> Any:
        import logging

        return getattr(logging.getLogger("nrvna"), name)

    def trace(self, message: str) -> None:
        """Log at the spec's TRACE level (below DEBUG)."""
        self.log(TRACE, message)

    def limited(self, cause: str, message: str, level: str = "error") -> None:
        """Log ``message`` at ``level`` unless a line of the same ``cause`` was logged in the
        last LOG_REPEAT_SECONDS: a lasting fault that every job meets (a full disk) would
        otherwise print a line per job per retry (584 lines in 10 s). The next line of that
        cause says how many were left out."""
        now = time.monotonic()
        with _LIMITED_LOCK:
            last, left_out = _LIMITED.get(cause, (None, 0))
            if last is not None and now - last < LOG_REPEAT_SECONDS:
                _LIMITED[cause] = (last, left_out + 1)
                return
            _LIMITED[cause] = (now, 0)
        if left_out:
            message += f" ({left_out} more like this in the last {now - last:.0f} s not logged)"
        getattr(self, level)(message)


def configure_logging(level: str = "info", stream: Any = None) -> None:
    """Send nrvna's log to ``stream`` (stderr) as ``[time] [LEVEL] [Thread] message``."""
    import logging

    logging.addLevelName(TRACE, "TRACE")
    tags = {logging.ERROR: "ERROR", logging.WARNING: "WARN ", logging.INFO: "INFO ",
            logging.DEBUG: "DEBUG", TRACE: "TRACE", logging.CRITICAL: "ERROR"}

    class SpecFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
            tag = tags.get(record.levelno, record.levelname[:5].ljust(5))
            text = f"[{stamp}.{int(record.msecs):03d}] [{tag}] [{record.threadName}] {record.getMessage()}"
            if record.exc_info and level in ("debug", "trace"):
                text += "\n" + self.formatException(record.exc_info)
            return text

    logger = logging.getLogger("nrvna")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(SpecFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel({"error": logging.ERROR, "warn": logging.WARNING, "info": logging.INFO,
                     "debug": logging.DEBUG, "trace": TRACE}[level])


def _name_os_thread(name: str) -> None:
    """Give the calling thread its log name in the OS too (``ps -T``, ``top -H``), on Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


log = _Log()


##############################################################################
# 4. File primitives: every file is written whole and fsynced before it counts; renames never replace
##############################################################################
# Owns how bytes reach the disk: write_file (a temporary name, fsync, rename, fsync of the
# directory) and move (a rename that never replaces). Invariant: a file counts only once whole
# and durable. Stateless: any thread.


FILE_MODE = 0o600
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_renameat2: Any = None  # False when the platform has none


def write_all(fd: int, data: bytes) -> None:
    """Write every byte: ``os.write`` may write less than asked without an error."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def write_file(dir_fd: int, name: str, data: bytes, sync: bool = True) -> None:
    """Write ``name`` inside an open directory: temporary name, fsync, rename into place.
    (``sync=False``: atomic but not durable, for files rewritten often and worth little.)

    The caller fsyncs the directory once after its last file, which makes the renames durable.
    Only one thread ever writes into a given job directory, so the temporary name is fixed.
    """
    temp = f".{name}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW | O_CLOEXEC,
                 FILE_MODE, dir_fd=dir_fd)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(temp, dir_fd)
        raise
    os.close(fd)
    os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _write_new(dir_fd: int, name: str, data: bytes) -> None:
    """Create ``name`` (it must not exist) and write all of ``data``; no fsync."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _unlink_quietly(name: str, dir_fd: Optional[int]) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def open_dir(path: str, dir_fd: Optional[int] = None) -> int:
    """Open a directory without following a symlink in its last component."""
    return os.open(path, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)


def fsync_dir(path: str) -> None:
    """fsync a directory so the entries created, renamed or removed in it are durable."""
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(dir_fd: int, name: str, limit: int) -> bytes:
    """Read a regular file in an open directory, refusing symlinks, FIFOs and oversize files."""
    try:
        fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise JobError("bad_request", f"{name} is a symbolic link; it was not followed") from None
        if err.errno == errno.EISDIR:
            raise JobError("bad_request", f"{name} is a directory, not a file") from None
        raise
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise JobError("bad_request", f"{name} is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise JobError("bad_request", f"{name} is not a regular file")
        if info.st_size > limit:
            raise JobError("bad_request", f"{name} is {info.st_size} bytes; the limit is {limit}")
        chunks = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise JobError("bad_request", f"{name} is over the limit of {limit} bytes")
        return data
    finally:
        os.close(fd)


def move(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` atomically, never replacing anything already at ``dst``.

    Plain ``rename()`` silently replaces an empty directory; ``renameat2(RENAME_NOREPLACE)``
    refuses with EEXIST. Where the platform lacks it, check first (racy only against a
    hostile writer of the workspace, which the 0700 layout already excludes).
    """
    global _renameat2
    if _renameat2 is None:
        _renameat2 = _load_renameat2()
    if _renameat2:
        if _renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), 1) == 0:  # AT_FDCWD, NOREPLACE
            return
        import ctypes

        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), src, None, dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def _load_renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _syncfs(path: str) -> None:
    """Flush every file and directory of the filesystem holding ``path`` in one call:
    a batch is made durable with one flush instead of several fsyncs per job."""
    import ctypes

    fd = open_dir(path)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if getattr(libc, "syncfs", None) is None:
            os.sync()  # no syncfs: flush every filesystem (slower, as safe)
            return
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


##############################################################################
# 5. Structured output: what a JSON schema or a GBNF grammar may hold, checked at submit on a bare
# Python; the rules llama-cpp-python's grammar converter lacks (numeric bounds, multipleOf,
# patterns, formats)
##############################################################################
# Owns what a JSON schema or a GBNF grammar may hold and nrvna's own grammar rules. Invariant:
# a schema or grammar that submit accepts is one the daemon can make and afford. Clients call it at
# submit, the workers and the Grammar thread in the daemon; GrammarShape and GrammarVocab say
# their own threads.


# The daemon turns a JSON schema into a grammar with llama-cpp-python's converter
# (llama_cpp.llama_grammar.SchemaConverter), which ignores what it does not know: a schema
# with "uniqueItems" would be accepted and its outputs could break it. So a schema is walked
# here, at submit, in the converter's own order, and every keyword it would drop is refused,
# or written by nrvna's own rules instead (bounds and multipleOf, pattern and format, lists of
# types), which the daemon puts in the converter's place. (The converter cannot run at submit:
# clients need no llama-cpp-python.)

# minItems/maxItems/minLength/maxLength above this are refused: the grammar grows with them.
SCHEMA_MAX_REPEAT = 500

# Schemas and grammars already checked in this process (a batch file repeats one schema on
# every line): key -> the error message, or None when it passed. Every worker's claim checks its
# job's schema, so the cache is read and evicted from many threads: only under _CHECKED_LOCK,
# never held while a check runs (two threads may check one key at once: they find the same).
_CHECKED: dict[Any, Optional[str]] = {}
_CHECKED_LOCK = threading.Lock()
_CHECKED_MAX = 256


def _checked(key: Any, check: Callable[[], None]) -> None:
    """Run ``check`` once per distinct ``key`` (a schema's or grammar's text)."""
    with _CHECKED_LOCK:
        known = key in _CHECKED
        error = _CHECKED.get(key)
    if not known:
        try:
            check()
        except InvalidInput as err:
            error = str(err)
        with _CHECKED_LOCK:
            _CHECKED[key] = error
            while len(_CHECKED) > _CHECKED_MAX:
                _CHECKED.pop(next(iter(_CHECKED)))
    if error is not None:
        raise InvalidInput(error)


# ============================================================================
# 5.1 Numbers
# ============================================================================
# number_rule: minimum, maximum and their exclusive forms, and multipleOf (_multiple_of, _multiples:
# a deterministic automaton over digits), written as digit-by-digit grammar rules. Invariant:
# every text a rule matches is a number the schema allows. Stateless.


# The converter ignores minimum/maximum; nrvna writes those rules itself: digit strings whose
# value lies within the bounds, sound by construction (every string the rule admits is in
# range) and complete for up to 15 fraction digits, without exponents.

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


_FRACTION_DIGITS = 15  # the most fraction digits a bounded number is generated with


_MULTIPLE_MAX_RULES = 2048


def number_rule(node: Mapping[str, Any], where: str = "", rules: Optional[dict[str, str]] = None,
                prefix: str = "multiple") -> str:
    """The GBNF expression (without trailing space) of the numbers or integers ``node``
    (a schema of type number or integer) allows by its bounds and multipleOf; InvalidInput if
    none. The rules an integer multipleOf needs are added to ``rules``, named ``prefix``-..."""
    import decimal

    step, digits = _multiple_of(node, where, node.get("type") == "integer")
    integer = digits == 0
    low = high = None
    low_strict = high_strict = False
    for key in _BOUNDS:
        value = node.get(key)
        if value is None:
            continue
        if isinstance(value, bool) and key.startswith("exclusive"):  # draft 4: a flag on minimum/maximum
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (_INF, -_INF):
            raise InvalidInput(f"schema {where or '/'}: {key} must be a finite number")
        bound = decimal.Decimal(repr(value)) if isinstance(value, float) else decimal.Decimal(value)
        if abs(bound) >= decimal.Decimal(10) ** 15 or -bound.as_tuple().exponent > _FRACTION_DIGITS:
            raise InvalidInput(f"schema {where or '/'}: {key} {value} is beyond what nrvna generates "
                               f"(|x| < 1e15, at most {_FRACTION_DIGITS} fraction digits)")
        if key in ("minimum", "exclusiveMinimum"):
            strict = key == "exclusiveMinimum" or node.get("exclusiveMinimum") is True
            if low is None or bound > low or (bound == low and strict):
                low, low_strict = bound, strict
        else:
            strict = key == "exclusiveMaximum" or node.get("exclusiveMaximum") is True
            if high is None or bound < high or (bound == high and strict):
                high, high_strict = bound, strict
    if integer:  # integers: the bounds become inclusive integer ones
        if low is not None:
            low, low_strict = (low.to_integral_value(decimal.ROUND_FLOOR) + 1 if low_strict
                               else low.to_integral_value(decimal.ROUND_CEILING)), False
        if high is not None:
            high, high_strict = (high.to_integral_value(decimal.ROUND_CEILING) - 1 if high_strict
                                 else high.to_integral_value(decimal.ROUND_FLOOR)), False
    branches = []
    if step > 1:  # integers, and the bounds are inclusive
        made: dict[str, str] = {} if rules is None else rules
        memo: dict[str, dict[Any, Any]] = {}
        if high is None or high >= 0:
            branches.append(_multiples(max(int(low or 0), 0), None if high is None else int(high), step, made, prefix,
                                       where, memo))
        if low is None or low < 0:
            least = max(1, -int(high)) if high is not None else 1
            text = _multiples(least, None if low is None else -int(low), step, made, prefix, where, memo)
            branches.append(f'"-" ({text})' if " | " in text else f'"-" {text}' if text else "")
        branches = [branch for branch in branches if branch]
    # Non-negative values: digits as they are; negative ones: "-" and the magnitude's digits.
    elif high is None or high > 0 or (high == 0 and not high_strict):
        floor = (low, low_strict) if low is not None and low >= 0 else (decimal.Decimal(0), False)
        branches += _magnitude_rules(floor, (high, high_strict), integer, digits)
    if step == 1 and (low is None or low < 0):
        ceiling = (-low, low_strict) if low is not None else (None, False)
        floor = (-high, high_strict) if high is not None and high < 0 else (decimal.Decimal(0), True)
        branches += [f'"-" {rule}' for rule in _magnitude_rules(floor, ceiling, integer, digits)]
    if not branches:
        what = f"multiple of {node['multipleOf']}" if step > 1 else "integer" if integer else "number"
        raise InvalidInput(f"schema {where or '/'}: no {what} lies within its bounds")
    return " | ".join(f"({branch})" if " | " in branch else branch for branch in branches)


def _magnitude_rules(low: tuple[Any, bool], high: tuple[Any, bool], integer: bool,
                     digits: int = _FRACTION_DIGITS) -> list[str]:
    """GBNF alternatives for the digit strings ``I`` or ``I.F`` (no sign, F at most ``digits``
    long) whose value m has low <= m <= high (each bound a (Decimal or None, strict) pair;
    strict: < or >)."""
    import decimal

    (lo, lo_strict), (hi, hi_strict) = low, high
    lo_int = int(lo.to_integral_value(decimal.ROUND_FLOOR))
    hi_int = None if hi is None else int(hi.to_integral_value(decimal.ROUND_FLOOR))
    if hi_int is not None and hi_int < lo_int:
        return []
    lo_frac = _fraction_digits(lo)
    hi_frac = None if hi is None else _fraction_digits(hi)
    rules = []

    def with_fraction(whole: str, floor: Optional[tuple[str, bool]], ceiling: Optional[tuple[str, bool]]) -> None:
        empty, fraction = _fraction_rule(floor, ceiling, digits)
        if integer:
            fraction = None
        if fraction is None and not empty:
            return
        if fraction is None:
            rules.append(whole)
        else:
            fraction = f"({fraction})" if " | " in fraction else fraction
            rules.append(f'{whole} ("." {fraction})' + ("?" if empty else ""))

    if hi_int is not None and lo_int == hi_int:  # one integer part: both bounds on the fraction
        with_fraction(f'"{lo_int}"', (lo_frac, lo_strict), (hi_frac, hi_strict))
        return rules
    with_fraction(f'"{lo_int}"', (lo_frac, lo_strict), None)
    middle = _natural_range(lo_int + 1, None if hi_int is None else hi_int - 1)
    if middle:
        with_fraction(f"({middle})" if " | " in middle else middle, None, None)
    if hi_int is not None:
        with_fraction(f'"{hi_int}"', None, (hi_frac, hi_strict))
    return rules


def _fraction_digits(value: Any) -> str:
    """The digits after the point of a non-negative Decimal, without trailing zeros."""
    sign, digits, exponent = value.normalize().as_tuple()
    if exponent >= 0:
        return ""
    text = "".join(map(str, digits)).rjust(-exponent, "0")
    return text[exponent:]


def _fraction_rule(floor: Optional[tuple[str, bool]], ceiling: Optional[tuple[str, bool]],
                   length: int) -> tuple[bool, Optional[str]]:
    """(whether no fraction at all qualifies, GBNF for the non-empty digit strings D of at most
    ``length`` digits that do) for the fractions 0.D within ``floor`` and ``ceiling``: (digits,
    strict) pairs compared as decimals (0.D >= 0.digits, or > when strict); None: no bound
    (0 <= 0.D < 1)."""

    def holds_empty(floor: Optional[tuple[str, bool]], ceiling: Optional[tuple[str, bool]]) -> bool:
        # the fraction 0 (no more digits)
        if floor is not None and (floor[1] or floor[0].strip("0")):
            return False
        return ceiling is None or not ceiling[1] or bool(ceiling[0].strip("0"))

    def digits(floor: Optional[tuple[str, bool]], ceiling: Optional[tuple[str, bool]], left: int) -> Optional[str]:
        if floor is not None and not floor[1] and not floor[0].strip("0"):
            floor = None  # >= 0: no bound at all
        if left == 0:
            return None
        if floor is None and ceiling is None:
            return f"[0-9]{{1,{left}}}" if left > 1 else "[0-9]"
        # The states that would recur digit by digit: "> 0 from here on" and "only zeros".
        if ceiling is None and floor == ("", True):  # not all zeros, at most ``left`` digits
            text = "[1-9]"
            for width in range(2, left + 1):
                text = f'[1-9] [0-9]{{0,{width - 1}}} | "0" ({text})'
            return text
        if floor is None and ceiling is not None and not ceiling[0]:
            return None if ceiling[1] else f"[0]{{1,{left}}}"
        # Group the first digit by what it leaves for the rest.
        groups: dict[tuple[Any, Any], list[int]] = {}
        for d in range(10):
            rest_floor: Any = None
            if floor is not None:
                first = int(floor[0][0]) if floor[0] else 0
                if d < first:
                    continue
                rest_floor = (floor[0][1:], floor[1]) if d == first else None
            rest_ceiling: Any = None
            if ceiling is not None:
                first = int(ceiling[0][0]) if ceiling[0] else 0
                if d > first:
                    continue
                rest_ceiling = (ceiling[0][1:], ceiling[1]) if d == first else None
            groups.setdefault((rest_floor, rest_ceiling), []).append(d)
        alternatives = []
        for (rest_floor, rest_ceiling), ds in groups.items():
            head = f"[{ds[0]}]" if len(ds) == 1 else f"[{ds[0]}-{ds[-1]}]"
            if ds != list(range(ds[0], ds[-1] + 1)):
                head = "[" + "".join(map(str, ds)) + "]"
            empty = holds_empty(rest_floor, rest_ceiling)
            tail = digits(rest_floor, rest_ceiling, left - 1)
            if tail is None:
                if empty:
                    alternatives.append(head)
            else:
                alternatives.append(f"{head} ({tail})" + ("?" if empty else ""))
        return " | ".join(alternatives) if alternatives else None

    return holds_empty(floor, ceiling), digits(floor, ceiling, length)


def _natural_range(low: int, high: Optional[int]) -> str:
    """GBNF for the decimal numerals (no leading zeros) of the integers from ``low`` to
    ``high`` (None: any, up to 16 digits); "" if there are none."""
    if high is None:
        length = len(str(low))
        first = _natural_range(low, 10 ** length - 1)
        return first if length >= 16 else f"{first} | [1-9] [0-9]{{{length},15}}"
    parts = []
    for length in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        end = min(high, 10 ** length - 1)
        if start <= end:
            parts.append(_same_length_range(str(start), str(end)))
    return " | ".join(parts)


def _same_length_range(low: str, high: str) -> str:
    """GBNF for the numerals of one length from ``low`` to ``high``."""
    if low == high:
        return f'"{low}"'
    if len(low) == 1:
        return f"[{low}-{high}]"
    if low[0] == high[0]:
        rest = _same_length_range(low[1:], high[1:])
        return f'"{low[0]}" ({rest})' if " | " in rest else f'"{low[0]}" {rest}'
    width = len(low) - 1
    parts = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * width:
        parts.append(f'"{low[0]}" ({_same_length_range(low[1:], "9" * width)})')
        first += 1
    tail = None
    if high[1:] != "9" * width:
        tail = f'"{high[0]}" ({_same_length_range("0" * width, high[1:])})'
        last -= 1
    if first <= last:
        head = f"[{first}]" if first == last else f"[{first}-{last}]"
        parts.append(f"{head} [0-9]{{{width}}}" if width > 1 else f"{head} [0-9]")
    if tail:
        parts.append(tail)
    return " | ".join(parts)


# Integers that are multiples of k, written a digit at a time by a deterministic automaton whose
# state is the remainder of the digits so far and how they compare with the bounds' digits;
# states with the same futures share a rule (for k = 100 only the last two digits matter). A
# number's multipleOf is an integer (its multiples are integers) or a power of ten (0.01: at most
# two fraction digits); any other step would need the fraction's digits and a remainder at once.

def _multiple_of(node: Mapping[str, Any], where: str, integer: bool) -> tuple[int, int]:
    """(k, d) for ``node``'s multipleOf: its values are multiples of the integer k (1: any)
    with at most d fraction digits (0: integers)."""
    import decimal
    import fractions

    value = node.get("multipleOf")
    if value is None:
        return 1, 0 if integer else _FRACTION_DIGITS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < _INF:
        raise InvalidInput(f"schema {where or '/'}: multipleOf must be a number above 0")
    step = fractions.Fraction(decimal.Decimal(repr(value)) if isinstance(value, float) else value)
    if step.numerator >= 10 ** 15 or step.denominator > 10 ** _FRACTION_DIGITS:
        raise InvalidInput(f"schema {where or '/'}: multipleOf {value} is beyond what nrvna generates "
                           f"(below 1e15, at most {_FRACTION_DIGITS} fraction digits)")
    if integer or step.denominator == 1:  # an integer n is a multiple of p/q (lowest terms) iff p divides n
        return step.numerator, 0
    digits = len(str(step.denominator)) - 1
    if step.numerator == 1 and step.denominator == 10 ** digits:
        return 1, digits
    raise InvalidInput(f"schema {where or '/'}: multipleOf {value} on a number is not supported: only an integer "
                       "or a power of ten (0.1, 0.01, ...) is (use type integer, or scale the values)")


def _multiples(low: int, high: Optional[int], step: int, rules: dict[str, str], prefix: str, where: str,
               memo: dict[str, dict[Any, Any]]) -> str:
    """GBNF for the numerals (no leading zeros) of the multiples of ``step`` from ``low`` to
    ``high`` (None: up to 16 digits), "" if there are none. A walk along the digits, whose state
    is (remainder so far, digits so far, how they compare with low's and high's first digits):
    deterministic (one parse stack, whatever the length), every state able to end, and one rule
    per set of states with the same futures (``future``); the rules are added to ``rules``,
    named ``prefix``-N, and shared with other ranges of the same step through ``memo``."""
    bottom, top = str(low), str(10 ** 16 - 1 if high is None else high)
    made: dict[Any, str] = memo.setdefault("made", {})
    live: dict[Any, bool] = memo.setdefault("live", {})
    twos = fives = 0  # step is 2^twos 5^fives k with k prime to 10: its 2s and 5s see the last digits alone
    while step % 2 ** (twos + 1) == 0:
        twos += 1
    while step % 5 ** (fives + 1) == 0:
        fives += 1
    tail = max(twos, fives)

    def future(state: tuple[int, int, int, int]) -> Any:
        # What decides which digits may follow. Off the bounds' own digits: how many may come
        # (least to most), and for each count m the value mod step they must have, -rest * 10^m;
        # past m = tail that is decided by rest * 10^tail mod step. (100 needs 3 sets per count, not 100.)
        rest, n, below, above = state
        if below == 0 or above == 0:
            return (bottom, top) + state
        least = max(0, len(bottom) - n + (below < 0))
        most = len(top) - n - (above > 0)
        needs = tuple(need if need < 10 ** m else None
                      for m in range(max(1, least), min(most, tail) + 1) for need in [-rest * 10 ** m % step])
        return rest == 0 if least == 0 else None, least, most, needs, rest * 10 ** tail % step if most > tail else None

    def after(state: tuple[int, int, int, int], d: int) -> Optional[tuple[int, int, int, int]]:
        rest, n, below, above = state  # below/above: -1, 0, 1 as the digits compare with low's/high's
        if n + 1 > len(top):
            return None
        below = 1 if n + 1 > len(bottom) else below or (d > int(bottom[n])) - (d < int(bottom[n]))
        return (rest * 10 + d) % step, n + 1, below, above or (d > int(top[n])) - (d < int(top[n]))

    def ends(state: tuple[int, int, int, int]) -> bool:
        rest, n, below, above = state
        return rest == 0 and (n > len(bottom) or (n == len(bottom) and below >= 0)) and (n < len(top) or above <= 0)

    def alive(state: Optional[tuple[int, int, int, int]]) -> bool:
        if state is None:
            return False
        key = future(state)
        if key not in live:
            live[key] = ends(state) or any(alive(after(state, d)) for d in range(10))
        return live[key]

    def digit_class(ds: list[int]) -> str:
        if len(ds) == 1:
            return f'"{ds[0]}"'
        return f"[{ds[0]}-{ds[-1]}]" if ds == list(range(ds[0], ds[-1] + 1)) else "[" + "".join(map(str, ds)) + "]"

    def moves(state: tuple[int, int, int, int], digits: range) -> list[str]:
        groups: dict[str, list[int]] = {}
        for d in digits:
            following = after(state, d)
            if alive(following):
                groups.setdefault(rule(following), []).append(d)
        return [f"{digit_class(ds)} {rest}".rstrip() for rest, ds in groups.items()]

    def rule(state: tuple[int, int, int, int]) -> str:  # "" where nothing may follow
        key = future(state)
        if key not in made:  # (no loops: a state's digits only grow)
            alternatives = moves(state, range(10))
            name = f"{prefix}-{len(rules)}" if alternatives else ""
            if alternatives:
                if len(rules) >= _MULTIPLE_MAX_RULES:
                    raise InvalidInput(f"schema {where or '/'}: multipleOf {step} needs more than "
                                       f"{_MULTIPLE_MAX_RULES:,} grammar rules within these bounds (a maximum, "
                                       "or a smaller multipleOf, needs fewer)")
                rules[name] = " | ".join(([""] if ends(state) else []) + alternatives)  # (empty first, as GBNF allows)
            made[key] = name
        return made[key]

    start = (0, 0, 0, 0)
    zero = ['"0"'] if low == 0 and 0 <= int(top) else []
    return " | ".join(zero + moves(start, range(1, 10)))


# ============================================================================
# 5.2 JSON strings
# ============================================================================
# Characters as the spans a grammar's classes hold, and a decoded character as the JSON text that
# writes it (_json_char_gbnf): raw or escaped, as JSON allows. Stateless.


# One character of a JSON string, as strict JSON and UTF-8 allow it. llama-cpp-python's
# converter lets a string hold raw control characters (its "char" rule is [^"\\]), which
# json.loads refuses; llama.cpp's own converter and JSON grammar exclude them, and so does nrvna.
# A \u escape is a BMP code point that is no surrogate, or a high surrogate followed by a low
# one: a lone surrogate (json.loads takes it) cannot be encoded in UTF-8 and strict parsers
# refuse it, and a pair is one character, so minLength/maxLength (a repetition of this rule)
# count characters as JSON Schema does. Raw text excludes what llama.cpp decodes from bytes
# that are not UTF-8 (surrogates, code points past U+10FFFF) for the same reason: a class of
# what is allowed, as llama.cpp refuses a token that ends inside a character (an ED byte
# alone, say) when any character it could begin is in a negated class (U+D000-U+D7FF too).
_JSON_HEX = "[0-9a-fA-F]"
_JSON_CHAR_RULE = (r'[\x20-\x21\x23-\x5B\x5D-\x7E\x80-\uD7FF\uE000-\U0010FFFF] | "\\" (["\\/bfnrt] | "u" ('
                   f'[0-9a-cA-CeEfF] {_JSON_HEX} {_JSON_HEX} {_JSON_HEX} | [dD] [0-7] {_JSON_HEX} {_JSON_HEX} | '
                   f'[dD] [89abAB] {_JSON_HEX} {_JSON_HEX} "\\\\u" [dD] [c-fC-F] {_JSON_HEX} {_JSON_HEX}))')
_JSON_SHORT_ESCAPES = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r"}

# Sets of code points are spans: sorted, disjoint, non-adjacent (first, last) pairs.
_LAST_POINT = 0x10FFFF
_BMP = ((0, 0xD7FF), (0xE000, 0xFFFF))  # the Basic Multilingual Plane without its surrogates
_JSON_RAW = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, _LAST_POINT))  # written as they are


def _spans(pairs: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(pairs):
        if out and low <= out[-1][1] + 1:
            if high > out[-1][1]:
                out[-1] = (out[-1][0], high)
        else:
            out.append((low, high))
    return tuple(out)


def _spans_not(spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for low, high in spans:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _LAST_POINT:
        out.append((start, _LAST_POINT))
    return tuple(out)


def _spans_and(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return _spans_not(_spans(_spans_not(a) + _spans_not(b)))


def _spans_hold(spans: tuple[tuple[int, int], ...], point: int) -> bool:
    return any(low <= point <= high for low, high in spans)


def _gbnf_class(spans: tuple[tuple[int, int], ...]) -> str:
    """A GBNF character class of ``spans``, every character but letters and digits escaped."""
    def one(point: int) -> str:
        if point < 0x80 and chr(point).isalnum():
            return chr(point)
        return f"\\x{point:02X}" if point < 0x100 else f"\\u{point:04X}" if point < 0x10000 else f"\\U{point:08X}"

    return "[" + "".join(one(low) + ("" if low == high else "-" + one(high)) for low, high in spans) + "]"


def _json_text(point: int) -> str:
    """How a JSON string writes the character ``point``: \\" \\\\ \\n \\u0001, else itself."""
    if point == 0x22 or point == 0x5C:
        return "\\" + chr(point)
    if point < 0x20:
        return "\\" + _JSON_SHORT_ESCAPES[point] if point in _JSON_SHORT_ESCAPES else f"\\u{point:04x}"
    return chr(point)


def _gbnf_literal(text: str) -> str:
    """A quoted GBNF literal of ``text`` (ASCII: anything else escaped)."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif " " <= c <= "~":
            out.append(c)
        else:
            point = ord(c)
            out.append(f"\\x{point:02X}" if point < 0x100 else f"\\u{point:04X}" if point < 0x10000 else f"\\U{point:08X}")
    return '"' + "".join(out) + '"'


def _json_char_gbnf(spans: tuple[tuple[int, int], ...]) -> tuple[str, bool]:
    """GBNF for one character of ``spans`` as a JSON string writes it (a quote, a backslash
    or a control character as its escape), and whether it is one element (a quantifier may
    follow it without parentheses)."""
    parts = []
    raw = _spans_and(spans, _JSON_RAW)
    if raw:
        parts.append(_gbnf_class(raw))
    for point in (0x22, 0x5C):
        if _spans_hold(spans, point):
            parts.append(_gbnf_literal(_json_text(point)))
    controls = [p for p in range(0x20) if _spans_hold(spans, p)]
    short = "".join(_JSON_SHORT_ESCAPES[p] for p in controls if p in _JSON_SHORT_ESCAPES)
    if short:
        parts.append(f'"\\\\" [{short}]' if len(short) > 1 else _gbnf_literal("\\" + short))
    for high in (0, 1):
        lows = [p & 0xF for p in controls if p >> 4 == high and p not in _JSON_SHORT_ESCAPES]
        if lows:
            parts.append(_gbnf_literal(f"\\u00{high}") + " [" + "".join(f"{low:x}" for low in lows) + "]")
    single = len(parts) == 1 and " " not in parts[0]
    return " | ".join(parts), single


# ============================================================================
# 5.3 Patterns
# ============================================================================
# The pattern compiler: a regex parsed (_Regex), made an automaton (_positions, _sweep) and
# measured (_pattern_shape) within fixed bounds of work. Invariant: a pattern's rules match the JSON
# strings whose text it matches. Stateless (_python_classes caches fixed values).


# A pattern is matched against the *decoded* string, by Python's re (python-jsonschema) or by
# ECMA-262 (what the JSON Schema spec, JavaScript validators and OpenAI mean), and the two differ:
# \d is [0-9] in ECMA-262 and every Unicode digit in Python, "." excludes \r in ECMA-262 only, and
# without its u flag ECMA-262 reads a character past U+FFFF as two. So a class here holds what
# both would match (a negated one: what neither would), and only characters of the BMP: a
# grammar made of them admits only strings that match under either.

# ECMA-262's \d, \w and \s (U+180E was a space before Unicode 6.3: older engines count it).
_ECMA_CLASSES = {"d": ((0x30, 0x39),), "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
                 "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x180E, 0x180E), (0x2000, 0x200A),
                       (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))}
_python_classes: dict[str, tuple[tuple[int, int], ...]] = {}
_REGEX_MAX_NESTING = 32  # groups within groups
_PATTERN_MAX_POSITIONS = 20_000  # characters of a pattern once its counted repetitions are written out
_PATTERN_MAX_STATES = 2_000  # grammar rules one pattern may become
_PATTERN_MAX_WORK = 3_000_000  # set operations to make one (about a second; most patterns take a few thousand)
_JSON_ANY = ((0, 0xD7FF), (0xE000, _LAST_POINT))  # any character a string may hold


# states: (whether the string may end there, ((spans, the state they lead to), ...)), state 0 first
# work: the set operations its automaton took (counted against _PATTERN_MAX_WORK and a schema's
# SCHEMA_MAX_PATTERN_WORK)
_PatternShape = namedtuple("_PatternShape", "states shortest longest work")  # longest: None = unbounded


class _PatternError(ValueError):
    """A pattern outside the subset: (where in it or None, what)."""


def _python_class(name: str) -> tuple[tuple[int, int], ...]:
    """The BMP characters Python's re matches with \\d, \\w or \\s in a str pattern (they are
    Unicode-aware), or "unassigned": those this Python's Unicode has no character for (a later
    one may make them digits or letters; a class that depends on \\d, \\w or \\s leaves them out)."""
    if not _python_classes:
        import unicodedata

        text = "".join(map(chr, range(0x10000)))
        found = {name: _spans((ord(c), ord(c)) for c in re.findall("\\" + name, text)) for name in "dws"}
        found["unassigned"] = _spans((p, p) for p in range(0x10000) if unicodedata.category(chr(p)) == "Cn")
        _python_classes.update(found)  # (whole: threads that race compute the same)
    return _python_classes[name]


def _positions(tree: tuple[Any, ...], sets: list[Any], follow: list[set[int]],
               budget: list[int]) -> tuple[bool, set[int], set[int]]:
    """Glushkov's construction: each character of ``tree`` (a counted repetition written out
    that many times) becomes a position, appended to ``sets`` (its characters) and ``follow``
    (the positions that may come next); returns (whether the tree matches "", its first
    positions, its last). Each link between positions is charged to ``budget``: nested
    repetitions of what may be empty link every position to every other."""
    kind = tree[0]
    if kind == "set":
        if len(sets) >= _PATTERN_MAX_POSITIONS:
            raise _PatternError(None, f"it is over {_PATTERN_MAX_POSITIONS:,} characters long once its counted "
                                      "repetitions are written out")
        sets.append(tree[1])
        follow.append(set())
        return False, {len(sets) - 1}, {len(sets) - 1}

    def link(last: set[int], first: set[int]) -> None:
        budget[0] -= len(last) * len(first)
        if budget[0] < 0:
            raise _PatternError(None, "it is too complex to make a grammar of (repetitions of what may be empty, "
                                      "nested: write them without the empty choice)")
        for position in last:
            follow[position] |= first

    if kind == "alt":
        parts = [_positions(choice, sets, follow, budget) for choice in tree[1]]
        return any(p[0] for p in parts), set().union(*(p[1] for p in parts)), set().union(*(p[2] for p in parts))
    if kind == "seq":
        items = [_positions(item, sets, follow, budget) for item in tree[1]]
    else:  # x{m,n}: m copies, then x* or n - m nested optional ones, (x(x(x)?)?)?
        _, item, least, most = tree
        if _may_be_empty(item):  # x{m,n} is x'{0,n}, x' its strings but "": linked in a line, not all to all
            item, least = _nonempty(item), 0
            if item is None:
                return True, set(), set()
        items = [_positions(item, sets, follow, budget) for _ in range(least)]
        if most is None:
            empty, first, last = _positions(item, sets, follow, budget)
            link(last, first)
            items.append((True, first, last))
        else:
            tail: tuple[bool, set[int], set[int]] = (True, set(), set())
            for empty, first, last in reversed([_positions(item, sets, follow, budget) for _ in range(most - least)]):
                link(last, tail[1])
                tail = (True, first | (tail[1] if empty else set()), tail[2] | last)
            items.append(tail)
    nullable, first, last = True, set(), set()
    for empty, item_first, item_last in items:
        link(last, item_first)
        first |= item_first if nullable else set()
        last = item_last | (last if empty else set())
        nullable = nullable and empty
    return nullable, first, last


def _may_be_empty(tree: tuple[Any, ...]) -> bool:
    kind = tree[0]
    if kind == "set":
        return False
    if kind == "rep":
        return tree[2] == 0 or _may_be_empty(tree[1])
    return (all if kind == "seq" else any)(map(_may_be_empty, tree[1]))


def _nonempty(tree: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
    """The tree of ``tree``'s strings but "" (None if it has no other)."""
    if not _may_be_empty(tree):
        return tree
    kind = tree[0]
    if kind == "seq":  # the first item that is not empty decides: x' y z | y' z | z'
        choices = []
        for i, item in enumerate(tree[1]):
            head = _nonempty(item)
            if head is not None:
                choices.append(("seq", (head,) + tree[1][i + 1:]))
    elif kind == "alt":
        choices = [choice for choice in map(_nonempty, tree[1]) if choice is not None]
    else:
        inner = _nonempty(tree[1])
        return None if inner is None or tree[3] == 0 else ("rep", inner, 1, tree[3])
    return None if not choices else choices[0] if len(choices) == 1 else ("alt", tuple(choices))


def _sweep(spans_of: dict[int, tuple[tuple[int, int], ...]]) -> list[tuple[int, int, frozenset]]:
    """The code points the sets of ``spans_of`` (key -> spans) tell apart: (first, last, the
    keys whose set holds them) for each run of code points some set holds."""
    events: dict[int, list[tuple[int, int]]] = {}
    for key, spans in spans_of.items():
        for low, high in spans:
            events.setdefault(low, []).append((key, 1))
            events.setdefault(high + 1, []).append((key, -1))
    edges = sorted(events)
    active: dict[int, int] = {}
    runs = []
    for edge, following in zip(edges, edges[1:] + [None]):
        for key, change in events[edge]:
            active[key] = active.get(key, 0) + change
            if not active[key]:
                del active[key]
        if active and following is not None:
            runs.append((edge, following - 1, frozenset(active)))
    return runs


@functools.lru_cache(maxsize=256)
def _pattern_shape(pattern: str) -> _PatternShape:
    """A pattern as a deterministic automaton on characters: one grammar rule per state, so that
    llama.cpp holds one parse stack however the pattern is written ((\\w+\\s?)+ included). A side
    not anchored (^, $) is any text: JSON Schema's pattern searches, as re.search does."""
    anything = ("rep", ("set", _JSON_ANY), 0, None)
    choices = tuple(("seq", (() if start else (anything,)) + (body,) + (() if end else (anything,)))
                    for start, body, end in _Regex(pattern).parse())
    sets: list[Any] = []
    follow: list[set[int]] = []
    budget = [_PATTERN_MAX_WORK]
    nullable, first, last = _positions(("alt", choices), sets, follow, budget)
    # The positions of one character set are swept as one, and a state's positions are
    # handled by set operations, never one by one in Python: .{0,500} is 500 positions of one
    # set, and a state after k characters holds k of them (one by one, the states of
    # ^.{0,500}.{0,500}.{0,400}$ took 6 s to make; so, about a tenth of a second).
    kinds: dict[Any, int] = {}
    kind_of = [kinds.setdefault(spans, len(kinds)) for spans in sets]
    spans_of = list(kinds)
    holding: list[set[int]] = [set() for _ in spans_of]  # kind -> the positions of that set
    for p, kind in enumerate(kind_of):
        holding[kind].add(p)
    follow_of = follow.__getitem__
    # From a position of "any text" that can end the string, every string that follows matches
    done = {p for p in last if sets[p] is _JSON_ANY and p in follow[p]}
    everything = frozenset((-2,))  # the state where every string that follows matches
    start = frozenset((-1,))  # the state before the first character
    numbers = {start: 0}
    order = [start]
    states = []
    for state in order:  # breadth first: a state's number is its place
        if state == everything:
            states.append((True, ((_JSON_ANY, numbers[state]),)))
            continue
        ahead = first if state == start else set().union(*map(follow_of, state))
        budget[0] -= len(ahead) + (0 if state == start else sum(map(len, map(follow_of, state))))
        if budget[0] < 0:
            raise _PatternError(None, "it is too complex to make a grammar of (its automaton takes too long to build)")
        moves: dict[int, list[tuple[int, int]]] = {}
        here = set(map(kind_of.__getitem__, ahead))
        groups = {kind: ahead if len(here) == 1 else ahead & holding[kind] for kind in here}
        for low, high, taken_kinds in _sweep({kind: spans_of[kind] for kind in groups}):
            taken = frozenset().union(*map(groups.__getitem__, taken_kinds))
            target = everything if taken & done else taken
            if target not in numbers:
                if len(order) >= _PATTERN_MAX_STATES:
                    raise _PatternError(None, f"it needs more than {_PATTERN_MAX_STATES:,} grammar states (each copy "
                                              "of a counted repetition has states of its own)")
                numbers[target] = len(order)
                order.append(target)
            moves.setdefault(numbers[target], []).append((low, high))
        ends = nullable if state == start else bool(state & last)
        states.append((ends, tuple((_spans(spans), target) for target, spans in moves.items())))
    shortest, longest = _path_lengths(states)
    return _PatternShape(tuple(states), shortest, longest, _PATTERN_MAX_WORK - budget[0])


def _path_lengths(states: list[tuple[bool, tuple[Any, ...]]]) -> tuple[int, Optional[int]]:
    """The fewest and most characters from state 0 to an end (None: no most, a loop is on the
    way: every state can reach an end, as every Glushkov position can)."""
    depth, queue, shortest = {0: 0}, [0], 0
    for state in queue:  # breadth first
        if states[state][0]:
            shortest = depth[state]
            break
        for _, target in states[state][1]:
            if target not in depth:
                depth[target] = depth[state] + 1
                queue.append(target)
    entering = [0] * len(states)
    for _, moves in states:
        for _, target in moves:
            entering[target] += 1
    ready, most, seen = [0], [0] * len(states), 0
    while ready:  # Kahn's order: a loop leaves states unseen
        state = ready.pop()
        seen += 1
        for _, target in states[state][1]:
            most[target] = max(most[target], most[state] + 1)
            entering[target] -= 1
            if not entering[target]:
                ready.append(target)
    if seen < len(states):
        return shortest, None
    return shortest, max(most[s] for s, (ends, _) in enumerate(states) if ends)


class _Regex:
    """A pattern parsed into a tree: ("set", spans) one character, ("seq", items), ("alt",
    choices), ("rep", item, least, most or None). ``parse`` gives the top-level alternatives,
    each (anchored at the start, its sequence, anchored at the end)."""

    def __init__(self, pattern: str) -> None:
        self.src = pattern
        self.pos = 0
        self.depth = 0

    def fail(self, message: str, pos: Optional[int] = None) -> None:
        raise _PatternError(self.pos if pos is None else pos, message)

    def peek(self, ahead: int = 0) -> str:
        return self.src[self.pos + ahead] if self.pos + ahead < len(self.src) else ""

    def parse(self) -> list[tuple[bool, tuple[Any, ...], bool]]:
        alternatives = []
        while True:
            start = self.peek() == "^"
            self.pos += start
            items = self.sequence(top=True)
            end = self.peek() == "$"
            self.pos += end
            alternatives.append((start, ("seq", tuple(items)), end))
            if self.peek() != "|":
                break
            self.pos += 1
        if self.pos < len(self.src):
            self.fail("an unmatched ')'")
        return alternatives

    def alternation(self) -> tuple[Any, ...]:
        choices = [self.sequence(top=False)]
        while self.peek() == "|":
            self.pos += 1
            choices.append(self.sequence(top=False))
        trees = [items[0] if len(items) == 1 else ("seq", tuple(items)) for items in choices]
        return trees[0] if len(trees) == 1 else ("alt", tuple(trees))

    def sequence(self, top: bool) -> list[tuple[Any, ...]]:
        items: list[tuple[Any, ...]] = []
        while True:
            c = self.peek()
            if c in ("", "|", ")"):
                return items
            if c == "^":
                self.fail("'^' is supported only at the start of the pattern or of one of its top-level alternatives")
            if c == "$":
                if top and self.peek(1) in ("", "|"):
                    return items
                self.fail("'$' is supported only at the end of the pattern or of one of its top-level alternatives")
            items.append(self.quantified(self.atom()))

    def atom(self) -> tuple[Any, ...]:
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.pos += 1
            return self.shape([(_spans_not(((0x0A, 0x0A),)), _spans_not(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))))],
                              False)
        if c == "\\":
            kind, value = self.escape(in_class=False)
            if kind == "class":
                return self.shape([value], False)
            return ("set", ((value, value),))
        if c in "*+?" or (c == "{" and self.brace() is not None):
            self.fail(f"nothing to repeat before '{c}'")
        point = ord(c)
        if 0xD800 <= point <= 0xDFFF:
            self.fail(f"U+{point:04X} is a surrogate, which no string holds")
        self.pos += 1
        return ("set", ((point, point),))

    def group(self) -> tuple[Any, ...]:
        start = self.pos
        self.pos += 1
        if self.peek() == "?":
            head = self.src[self.pos:self.pos + 4]
            names = {"?=": "a lookahead (?=...)", "?!": "a negative lookahead (?!...)", "?<=": "a lookbehind (?<=...)",
                     "?<!": "a negative lookbehind (?<!...)", "?P=": "a backreference (?P=name)",
                     "?#": "a comment (?#...)", "?>": "an atomic group (?>...)", "?(": "a conditional (?(...)...)"}
            for prefix in sorted(names, key=len, reverse=True):
                if head.startswith(prefix):
                    self.fail(f"{names[prefix]} is not supported (the grammar cannot express it)", start)
            if head.startswith("?:"):
                self.pos += 2
            elif head.startswith(("?P<", "?<")):
                match = re.compile(r"\?P?<([A-Za-z_][A-Za-z0-9_]*)>").match(self.src, self.pos)
                if not match:
                    self.fail("a group name must be letters, digits and '_', not starting with a digit", start)
                self.pos = match.end()
            else:
                self.fail("inline flags ((?i), (?s), (?x), ...) are not supported: the grammar holds the pattern "
                          "as written", start)
        self.depth += 1
        if self.depth > _REGEX_MAX_NESTING:
            self.fail(f"groups nested more than {_REGEX_MAX_NESTING} deep", start)
        inner = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            self.fail("a '(' without its ')'", start)
        self.pos += 1
        return inner

    def brace(self) -> Optional[tuple[int, Optional[int], int]]:
        """The repetition {m}, {m,} or {m,n} at ``pos`` as (m, n or None, where it ends); None
        where the "{" is a character to both Python and ECMA-262 ("{", "{}", "{a")."""
        match = re.compile(r"\{(\d*)(,?)(\d*)\}").match(self.src, self.pos)
        if match is None or not (match.group(1) or match.group(2)):
            return None
        if not match.group(1):
            self.fail("{,n} is a repetition to Python and text to ECMA-262: write {0,n}")
        least = int(match.group(1))
        most = least if not match.group(2) else int(match.group(3)) if match.group(3) else None
        return least, most, match.end()

    def quantified(self, item: tuple[Any, ...]) -> tuple[Any, ...]:
        c = self.peek()
        if c == "{":
            found = self.brace()
            if found is None:
                return item
            least, most, self.pos = found
        elif c in ("*", "+", "?"):
            least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.pos += 1
        else:
            return item
        for count in (least, most):
            if count is not None and count > SCHEMA_MAX_REPEAT:
                self.fail(f"a repetition count above {SCHEMA_MAX_REPEAT} is not supported (the grammar grows with it)")
        if most is not None and most < least:
            self.fail(f"{{{least},{most}}}: the most is less than the least")
        if item[0] == "set" and item[1][0][0] > 0xFFFF:
            self.fail("a quantifier after a character beyond U+FFFF: ECMA-262 without its u flag would repeat "
                      "half of it (put it in a group)")
        if self.peek() == "?":
            self.pos += 1  # lazy: which match is found changes, whether one is found does not
        elif self.peek() == "+":
            self.fail("a possessive quantifier (*+, ++, ?+, {m,n}+) is not supported")
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.brace() is not None):
            self.fail("a quantifier right after another (put the first in a group)")
        return ("rep", item, least, most)

    def char_class(self) -> tuple[Any, ...]:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        if self.peek() == "]":
            self.fail("a ']' first in a class is a character to Python and ends an empty class in ECMA-262: write \\]")
        parts: list[tuple[Any, Any]] = []
        while self.peek() != "]":
            if not self.peek():
                self.fail("a '[' without its ']'", start)
            if self.src.startswith(("--", "&&", "~~", "||"), self.pos):
                self.fail(f"{self.src[self.pos:self.pos + 2]!r} in a class (Python warns that it will mean set "
                          "operations, as in ECMA-262's v flag): escape one of them")
            if self.peek() == "[":
                self.fail("a '[' inside a class (a nested set to some engines): write \\[")
            kind, low = self.class_atom()
            if kind == "class":
                if self.peek() == "-" and self.peek(1) not in ("]", ""):
                    self.fail("a range with \\d, \\w or \\s at an end (Python refuses it, ECMA-262 reads a '-')")
                parts.append(low)
                continue
            high = low
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                kind, high = self.class_atom()
                if kind == "class":
                    self.fail("a range with \\d, \\w or \\s at an end (Python refuses it, ECMA-262 reads a '-')")
                if high < low:
                    self.fail(f"the range {chr(low)!r}-{chr(high)!r} is out of order")
            span = ((low, high),)
            parts.append((span, span))
        self.pos += 1
        return self.shape(parts, negated)

    def class_atom(self) -> tuple[str, Any]:
        if self.peek() == "\\":
            return self.escape(in_class=True)
        point = ord(self.peek())
        if point > 0xFFFF:
            self.fail("a character beyond U+FFFF in a class: ECMA-262 without its u flag reads it as two")
        if 0xD800 <= point <= 0xDFFF:
            self.fail(f"U+{point:04X} is a surrogate, which no string holds")
        self.pos += 1
        return "char", point

    def escape(self, in_class: bool) -> tuple[str, Any]:
        """An escape at ``pos``: ("char", code point) or ("class", (letter, negated)) for \\d \\w \\s
        and their negations."""
        start = self.pos
        c = self.peek(1)
        self.pos += 2
        if not c:
            self.fail("a pattern cannot end with '\\'", start)
        if c in "dwsDWS":
            return "class", (c.lower(), c.isupper())
        simple = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B}
        if c in simple:
            return "char", simple[c]
        if c == "0":
            if self.peek().isdigit():
                self.fail("octal escapes are not supported: write \\xHH", start)
            return "char", 0
        if c == "b" and in_class:
            return "char", 0x08
        if c in "xu":
            size = 2 if c == "x" else 4
            digits = self.src[self.pos:self.pos + size]
            if c == "u" and self.peek() == "{":
                self.fail("\\u{...} is ECMA-262's u flag only: write \\uXXXX or the character", start)
            if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} needs {size} hex digits", start)
            self.pos += size
            point = int(digits, 16)
            if 0xD800 <= point <= 0xDFFF:
                self.fail(f"\\u{digits} is a surrogate (write the character itself)", start)
            return "char", point
        refused = {"b": "\\b (a word boundary)", "B": "\\B (not a word boundary)", "p": "\\p{...} (a Unicode property)",
                   "P": "\\P{...} (a Unicode property)", "k": "a backreference (\\k<name>)",
                   "c": "\\cX (a control character to ECMA-262, not to Python; write \\xHH)",
                   "A": "\\A (Python's start anchor, ECMA-262's letter A; write ^)", "Z": "\\Z (write $)",
                   "z": "\\z (write $)", "G": "\\G", "U": "\\U (Python only; write the character)",
                   "N": "\\N{...} (Python only; write the character)", "a": "\\a (Python only; write \\x07)"}
        if c in "123456789":
            self.fail(f"a backreference (\\{c}) is not supported (the grammar cannot express it)", start)
        if c in refused:
            self.fail(f"{refused[c]} is not supported", start)
        if c.isascii() and c.isalnum():
            self.fail(f"the escape \\{c} is not supported", start)
        point = ord(c)
        if point > 0xFFFF and in_class:
            self.fail("a character beyond U+FFFF in a class: ECMA-262 without its u flag reads it as two", start)
        return "char", point  # an escaped sign: the sign itself

    def shape(self, parts: list[tuple[Any, Any]], negated: bool) -> tuple[Any, ...]:
        """One character: of the parts (Python's set, ECMA-262's set) and shorthands (letter,
        negated), what both would match (negated: what neither would), in the BMP. Python's \\d,
        \\w, \\s are this Python's: a character that is unassigned here is kept only where it
        would be whatever a later Unicode makes it (a digit, a letter, a space or none)."""
        fixed = [part for part in parts if not isinstance(part[0], str)]
        shorthands = [part for part in parts if isinstance(part[0], str)]
        ecma = _spans([span for _, spans in fixed for span in spans]
                      + [span for letter, negative in shorthands
                         for span in (_spans_not(_ECMA_CLASSES[letter]) if negative else _ECMA_CLASSES[letter])])
        unassigned = _python_class("unassigned") if shorthands else ()
        found: Optional[tuple[tuple[int, int], ...]] = None
        for later in range(8 if shorthands else 1):  # which of \\d \\w \\s the unassigned would join
            python = [span for spans, _ in fixed for span in spans]
            for letter, negative in shorthands:
                matched = _python_class(letter)
                if later >> "dws".index(letter) & 1:
                    matched = _spans(matched + unassigned)
                python += _spans_not(matched) if negative else matched
            spans = _spans_not(_spans(tuple(python) + ecma)) if negated else _spans_and(_spans(python), ecma)
            found = spans if found is None else _spans_and(found, spans)
        spans = _spans_and(found or (), _BMP)
        if not spans:
            self.fail("a class that no character matches (under both Python and ECMA-262)")
        return ("set", spans)


# ============================================================================
# 5.4 Formats and types
# ============================================================================
# The formats a string may name (SCHEMA_FORMATS, each a pattern), string_rule (lengths, pattern and
# format together) and the choices of the type keyword. Stateless.


# String formats: each an anchored pattern, made a grammar as a pattern is. Every string one
# admits passes python-jsonschema's FormatChecker (with jsonschema[format-nongpl]) and its RFC:
# dates exist (30 days in April, 29 in February in leap years only), hostnames are at most 4
# labels of 62 characters (253 in all), e-mail addresses a dot-atom local part (RFC 5321) of at
# most 62 characters and a hostname of 2 to 4 labels of 40, IPv6 addresses without an IPv4 tail.
_YEAR = "(?:[0-9]{3}[1-9]|[0-9][0-9][1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999: RFC 3339 has no year 0
_LEAP_YEAR = "(?:[0-9][0-9](?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_COUNT = "[0-9]{1,9}"
_DURATION_TIME = f"T(?:{_COUNT}H(?:{_COUNT}M(?:{_COUNT}S)?)?|{_COUNT}M(?:{_COUNT}S)?|{_COUNT}S)"
_DURATION_DATE = f"(?:{_COUNT}D|{_COUNT}M(?:{_COUNT}D)?|{_COUNT}Y(?:{_COUNT}M(?:{_COUNT}D)?)?)"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = "[0-9a-fA-F]{1,4}"
_IPV6 = "|".join([f"(?:{_H16}:){{7}}{_H16}", f"(?:{_H16}:){{1,7}}:"]
                 + [f"(?:{_H16}:){{1,{6 - i}}}(?::{_H16}){{1,{i + 1}}}" for i in range(5)]
                 + [f"{_H16}:(?::{_H16}){{1,6}}", f":(?:(?::{_H16}){{1,7}}|:)"])


# A schema whose "type" is a list is one schema per type, each with the keywords for its type.
SCHEMA_TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": _BOUNDS + ("multipleOf",), "integer": _BOUNDS + ("multipleOf",),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties"),
    "boolean": (), "null": (),
}


def _label(most: int) -> str:
    return f"[A-Za-z0-9](?:[A-Za-z0-9-]{{0,{most - 2}}}[A-Za-z0-9])?"


def _uuid(version: str) -> str:
    hex_ = "[0-9a-fA-F]"
    if not version:
        return f"^{hex_}{{8}}-{hex_}{{4}}-{hex_}{{4}}-{hex_}{{4}}-{hex_}{{12}}$"
    return f"^{hex_}{{8}}-{hex_}{{4}}-{version}{hex_}{{3}}-[89abAB]{hex_}{{3}}-{hex_}{{12}}$"  # RFC 4122's variant


def string_rule(node: Mapping[str, Any], where: str = "", rules: Optional[dict[str, str]] = None,
                prefix: str = "pattern") -> str:
    """The GBNF expression for the text between the quotes of the strings ``node`` (a string
    schema with a pattern or a format) allows, its rules added to ``rules`` (named
    ``prefix``-N); InvalidInput naming what is outside the subset. minLength/maxLength beside
    them are taken where the pattern's own lengths keep within them, and refused elsewhere
    (the grammar would have to count both at once)."""
    pattern, name = node.get("pattern"), node.get("format")
    here = f"schema {where or '/'}"
    if "pattern" in node and "format" in node:
        raise InvalidInput(f"{here}: give pattern or format, not both (the grammar enforces one)")
    if "format" in node:  # {"format": null} is a format error, not the pattern's
        if not isinstance(name, str):
            raise InvalidInput(f"{here}: format must be a string (supported: {', '.join(SCHEMA_FORMATS)})")
        if name not in SCHEMA_FORMATS:
            raise InvalidInput(f"{here}: format {name!r} is not supported (supported: {', '.join(SCHEMA_FORMATS)})")
        shape, what = _pattern_shape(SCHEMA_FORMATS[name]), f"format {name!r}"
    else:
        if not isinstance(pattern, str):
            raise InvalidInput(f"{here}: pattern must be a string")
        try:
            shape = _pattern_shape(pattern)
        except _PatternError as err:
            place = "" if err.args[0] is None else f" (at character {err.args[0] + 1})"
            raise InvalidInput(f"{here}: pattern {pattern!r}: {err.args[1]}{place}") from None
        what = "the pattern"
    low, high = node.get("minLength", 0), node.get("maxLength")
    if low > shape.shortest or (high is not None and (shape.longest is None or shape.longest > high)):
        span = f"{shape.shortest} to {shape.longest}" if shape.longest is not None else f"{shape.shortest} or more"
        raise InvalidInput(f"{here}: minLength/maxLength beside {what} are supported only where its own strings "
                           f"keep within them, and its strings are {span} characters long (bound the pattern's "
                           "repetitions instead, anchored with ^ and $)")
    made = {} if rules is None else rules
    names = [f"{prefix}-{i}" for i in range(len(shape.states))]
    last = [ends and not moves for ends, moves in shape.states]  # nothing may follow: no rule
    uses: dict[Any, int] = {}
    for _, moves in shape.states:
        for spans, _ in moves:
            uses[spans] = uses.get(spans, 0) + 1
    characters: dict[Any, str] = {}
    for spans, count in uses.items():
        text, single = _json_char_gbnf(spans)
        if count > 1 and len(text) > 24:  # a long class used by several states: a rule of its own
            made[f"{prefix}-c{len(characters)}"] = text
            text, single = f"{prefix}-c{len(characters)}", True
        characters[spans] = text if single else f"({text})"
    for i, (ends, moves) in enumerate(shape.states):
        if not last[i]:
            alternatives = [""] if ends else []  # (the empty one first, as GBNF allows)
            for spans, target in moves:
                alternatives.append(characters[spans] + ("" if last[target] else f" {names[target]}"))
            made[names[i]] = " | ".join(alternatives)
    return '""' if last[0] else names[0]


def type_choices(node: Mapping[str, Any]) -> list[dict[str, Any]]:
    """{"type": ["integer", "null"], "minimum": 0} as [{"type": "integer", "minimum": 0},
    {"type": "null"}]: the anyOf both the check and the converter read it as."""
    return [{"type": kind, **{key: value for key, value in node.items() if key in SCHEMA_TYPE_KEYWORDS[kind]}}
            for kind in node["type"]]


SCHEMA_FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": f"^P(?:{_DURATION_DATE}(?:{_DURATION_TIME})?|{_DURATION_TIME}|{_COUNT}W)$",
    "email": (r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,20}(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,20}){0,2}"
              rf"@{_label(40)}(?:\.{_label(40)}){{1,3}}$"),
    "hostname": rf"^{_label(62)}(?:\.{_label(62)}){{0,3}}$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
    "ipv6": f"^(?:{_IPV6})$",
    "uuid": _uuid(""), **{f"uuid{v}": _uuid(str(v)) for v in range(1, 6)},
}


# ============================================================================
# 5.5 Grammar work
# ============================================================================
# GrammarShape follows llama.cpp's stacks to bound what a grammar costs per token (GRAMMAR_STACKS,
# GRAMMAR_PATHS, GRAMMAR_VOCAB_WORK); GrammarVocab holds a vocabulary's texts for it. Each worker
# counts with its own fork of a shape; GrammarVocab locks its decoding.


# llama.cpp tracks a grammar as a set of pushdown stacks, one per way the text so far parses, and
# checks a candidate token by walking its characters down each stack, without merging walks that
# meet again. An ambiguous grammar (x ::= [a-z] x "." | [a-z] x "," ...) multiplies both with
# every character, inside C calls nothing can interrupt: a worker stalled for good. GrammarShape
# is that machinery in Python, counting instead of matching, so that llama.cpp is never asked to
# do more than these limits: a grammar whose start already would is refused at submit, a job
# that reaches such a state fails (grammar_error) before the call. Counted work, not seconds,
# decides, so the machine's load never does. The README's Guarantees give the bound.

GRAMMAR_STACKS = 4096  # parse stacks open at once (an enum of 3,000 strings opens 3,000)
GRAMMAR_PATHS = 65536  # stack steps to check one candidate token, as llama.cpp walks them


# Stack steps to check the whole vocabulary in one state, the most a step of a job may take:
# llama.cpp walked 1.7e8 to 4.1e8 steps a second on the 2-core test machine (an enum of 3,000
# strings inside an object: 2.4e8 steps, 1.45 s), plus about 0.4 us a token.
GRAMMAR_VOCAB_WORK = 400_000_000
GRAMMAR_SUBMIT_CHARS = 16  # how far past its start a grammar is checked at submit
GRAMMAR_CHECK_WORK = 1_000_000  # dict operations GrammarShape may take to answer one question


# The submit check counts on the top elements of stacks alone: walks multiply there, and stacks
# that differ only deeper (JSON nested 30 deep, or 31) count as one state, their walks added.
GRAMMAR_COST_DEPTH = 3
GRAMMAR_VOCAB_PARTIALS = 64  # half-done characters whose tokens' code points a GrammarVocab keeps
_UTF8_LENGTHS = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)  # by a first byte's high 4 bits
Stack = tuple  # positions in GrammarShape.elements, the top last
GrammarState = tuple  # (frozenset of stacks, (partial UTF-8 value, bytes it still needs))


class GrammarLimit(Exception):
    """A grammar step would take more work than nrvna allows (the message says which)."""


def grammar_code_points(piece: bytes, partial: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
    """llama.cpp's decode_utf8 (llama-grammar.cpp): the code points ``piece`` completes after
    ``partial`` (value, bytes still to come), and the partial character it ends in; an invalid
    byte gives no code points and (0, -1), which llama.cpp's grammar refuses."""
    end = piece.find(b"\0")  # C strings
    data = piece if end < 0 else piece[:end]
    value, remain = partial
    points: list[int] = []
    i = 0
    while i < len(data) and remain > 0:
        if data[i] >> 6 != 2:
            return [], (0, -1)
        value, remain, i = (value << 6) + (data[i] & 0x3F), remain - 1, i + 1
    if partial[1] > 0 and remain == 0:
        points.append(value)
    while i < len(data):
        remain = _UTF8_LENGTHS[data[i] >> 4] - 1
        if remain < 0:
            return [], (0, -1)
        value, i = data[i] & ((1 << (7 - remain)) - 1), i + 1
        while i < len(data) and remain > 0:
            value, remain, i = (value << 6) + (data[i] & 0x3F), remain - 1, i + 1
        if remain == 0:
            points.append(value)
    return points, ((value, remain) if remain > 0 else (0, 0))


class _VocabWalk:
    """One count of GrammarShape.vocab_cost: the tokens walked a character at a time together,
    grouped by the set of stacks (with their walks) each has reached; each set is numbered
    here, and how its stacks split on characters (``children``) is remembered in the shape's
    ``splits``."""

    def __init__(self, np: Any, splits: dict[Any, Any],
                 children: Callable[..., tuple[list[int], list[dict[Stack, int]]]]) -> None:
        self.np, self.splits, self.children = np, splits, children
        self.ids_of: dict[Any, int] = {}  # a set of stacks with their walks -> its number here
        self.groups: list[tuple[Any, dict[Stack, int]]] = []  # by number: (its key, the set)
        self.walks: list[int] = []
        self.moves: dict[int, tuple[Any, Any]] = {}  # number -> (edges, the numbers its ranges lead to)
        self.budget = [GRAMMAR_CHECK_WORK]

    def number(self, items: dict[Stack, int]) -> int:
        """The number of a set of stacks, numbered when first seen."""
        key = frozenset(items.items())
        found = self.ids_of.get(key)
        if found is None:
            found = self.ids_of[key] = len(self.groups)
            self.groups.append((key, items))
            self.walks.append(sum(items.values()))
        return found

    def move(self, kind: int) -> tuple[Any, Any]:
        """Where set ``kind`` goes on each range of characters: (the ranges' first code points,
        the numbers of the sets they lead to)."""
        np = self.np
        found = self.moves.get(kind)
        if found is None:
            key, items = self.groups[kind]
            split = self.splits.get(key)
            if split is None:
                edges, children = self.children(items, self.budget)
                split = (np.asarray(edges, dtype=np.int64), children)
                if len(self.splits) > 10_000:
                    self.splits.clear()
                self.splits[key] = split
            edges, children = split
            found = self.moves[kind] = (edges, np.asarray([self.number(child) for child in children], dtype=np.int64))
        return found

    def cost(self, state: GrammarState, vocab: GrammarVocab, ids: Any) -> tuple[int, int]:
        """The steps to check every token of ``vocab`` (or those of ``ids``) in ``state``, and
        the most one token takes; GrammarLimit once one token takes more than GRAMMAR_PATHS."""
        np = self.np
        stacks, partial = state
        columns, lengths, rank = vocab.points(partial)
        rows = np.arange(len(lengths)) if ids is None else np.asarray(ids, dtype=np.int64)
        group = np.full(len(rows), self.number({stack: 1 for stack in stacks}), dtype=np.int64)
        spent = np.zeros(len(rows), dtype=np.int64)  # steps so far, per token still being walked
        total = worst = 0
        for column in range(len(columns) + 1):
            taken = np.asarray(self.walks, dtype=np.int64)[group]  # each walk checks this character (or the end)
            spent += taken
            total += int(taken.sum())
            going = (taken > 0) & (lengths[rows] > column)
            if len(spent):
                worst = max(worst, int(spent.max()))
            if worst > GRAMMAR_PATHS:
                raise GrammarLimit(f"too ambiguous: checking a token here takes {worst:,} parse steps "
                                   f"(the limit is {GRAMMAR_PATHS:,})")
            if not going.all():
                rows, group, spent = rows[going], group[going], spent[going]
            if not len(rows) or column == len(columns):
                break
            characters = columns[column][rank[rows]]  # every row left is longer than ``column``
            if group[0] == group[-1] and (group == group[0]).all():  # one set of stacks: the common case
                edges, targets = self.move(int(group[0]))
                group = targets[np.searchsorted(edges, characters, side="right") - 1]
                continue
            before = group.copy()
            for kind in np.unique(before).tolist():
                these = before == kind
                edges, targets = self.move(kind)
                group[these] = targets[np.searchsorted(edges, characters[these], side="right") - 1]
        return total, worst


class GrammarVocab:
    """A model's tokens as llama.cpp's grammar sees them: each token's code points (by column:
    see _decode), per partial UTF-8 character a job may be in (made when first needed)."""

    def __init__(self, np: Any, pieces: list[bytes]) -> None:
        self.np = np
        self.pieces = pieces  # b"" for tokens llama.cpp rejects outright (end of generation, empty)
        # Only these can go on with a character half done (a continuation byte first): for the
        # others llama.cpp's decoding fails at once, and a job's state after half a character
        # (CJK, emoji split into byte tokens) needs only their rows, a few hundred
        self.continuing = [i for i, piece in enumerate(pieces) if piece and piece[0] >> 6 == 2]
        self.decoded: dict[tuple[int, int], tuple[list[Any], Any, Any]] = {}  # partial -> (columns, lengths, rank)
        self.lock = threading.Lock()  # workers share it: one decodes, the others wait for that

    def points(self, partial: tuple[int, int]) -> tuple[list[Any], Any, Any]:
        """In the state ``partial`` (a character half done), the tokens' code points by column
        (see _decode), each token's length in code points, and each token's rank in the columns."""
        found = self.decoded.get(partial)
        if found is not None:
            return found
        with self.lock:
            return self._decode(partial)

    def _decode(self, partial: tuple[int, int]) -> tuple[list[Any], Any, Any]:
        found = self.decoded.get(partial)
        if found is None:
            np = self.np
            which = range(len(self.pieces)) if partial == (0, 0) else self.continuing
            rows = {i: grammar_code_points(self.pieces[i], partial)[0] for i in which if self.pieces[i][:1] not in (b"", b"\0")}
            lengths = np.zeros(len(self.pieces), dtype=np.int64)
            for i, row in rows.items():
                lengths[i] = len(row)
            # Column c holds the c-th code point of every token longer than c, longest tokens
            # first, so a token's place in every column is its rank. A matrix padded to the
            # longest token took 15 MiB for SmolLM2 (its longest is 81 code points, most are
            # under 8) and more than 100 MiB for a 150,000-token vocabulary; this takes the
            # code points and two indexes (2.0 MiB for SmolLM2).
            by_length = sorted(rows, key=lambda i: -len(rows[i]))
            rank = np.zeros(len(self.pieces), dtype=np.int64)
            rank[by_length] = np.arange(len(by_length))
            width = len(rows[by_length[0]]) if by_length else 0
            columns: list[list[int]] = [[] for _ in range(width)]
            for i in by_length:
                for column, point in enumerate(rows[i]):
                    columns[column].append(point)
            if len(self.decoded) >= GRAMMAR_VOCAB_PARTIALS:  # (the whole vocabulary's is 2 MiB for SmolLM2)
                self.decoded.pop(next(iter(self.decoded)))
            found = self.decoded[partial] = ([np.array(c, dtype=np.int32) for c in columns], lengths, rank)
        return found


class GrammarShape:
    """A grammar as llama.cpp holds it (element arrays; a stack is a tuple of positions in
    them), to count what llama.cpp will do with it. ``walk`` follows one token as
    llama_grammar_apply and llama_grammar_accept_token do; ``vocab_cost`` counts checking every
    token of a vocabulary in a state; ``check`` is the submit-time test of the start.

    Threads: its memos change as it counts, so one thread at a time counts with a shape: the
    one that makes it (a client's submit, the runner's Grammar thread or a worker) checks it;
    once LlamaRunner keeps it, it is never counted with again, and each worker counts with its
    own ``fork`` (see _GrammarTemplates)."""

    def __init__(self, rules: Mapping[int, list[list[tuple[Any, ...]]]], root: int) -> None:
        alternatives: dict[int, list[Optional[int]]] = {}  # rule -> its alternatives' first positions
        elements: list[Any] = []  # ("ref", rule) or ("sym", positive, ranges); None ends an alternative
        for rule_id, rule in rules.items():
            alternatives[rule_id] = []
            for alternative in rule:
                alternatives[rule_id].append(len(elements) if alternative else None)
                elements += alternative
                elements.append(None)
        self.elements = elements
        self.alternatives = {rule_id: tuple(a) for rule_id, a in alternatives.items()}
        self._new_memos()
        stacks: dict[Stack, None] = {}
        for first in self.alternatives[root]:
            stacks.update(dict.fromkeys(self.advance(() if first is None else (first,))))
        self.start: GrammarState = (frozenset(stacks), (0, 0))

    def _new_memos(self) -> None:
        self.advanced: dict[Stack, tuple[Stack, ...]] = {}
        self.costs: dict[Any, int] = {}  # (stacks and walks, depth) -> the most steps (check)
        self.splits: dict[Any, Any] = {}  # stacks and walks -> (edges, children) (vocab_cost)
        self.vocab_costs: dict[Any, tuple[int, int]] = {}  # state -> (whole vocabulary, worst token)
        self.asked: set[Any] = set()  # states whose part of the vocabulary was counted once

    def fork(self) -> GrammarShape:
        """The same grammar with memos of its own, for one thread to count with: its elements
        and start are shared (never changed once made), its memos start empty."""
        import copy

        twin = copy.copy(self)
        twin._new_memos()
        return twin

    def _pop(self, stack: Stack) -> tuple[Stack, ...]:
        """The stacks after ``stack``'s top class matched a character."""
        position = stack[-1] + 1
        return self.advance(stack[:-1] + (position,) if self.elements[position] is not None else stack[:-1])

    def advance(self, stack: Stack) -> tuple[Stack, ...]:
        """llama_grammar_advance_stack: the stacks ``stack`` expands to, each topped by a
        character class (or empty: the grammar complete). Remembered: stacks recur."""
        found = self.advanced.get(stack)
        if found is not None:
            return found
        out: dict[Stack, None] = {}
        seen: set[Stack] = set()
        todo = [stack]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            element = self.elements[current[-1]] if current else None
            if element is None or element[0] == "sym":
                out[current] = None
                continue
            after = current[-1] + 1
            below = current[:-1] + (after,) if self.elements[after] is not None else current[:-1]
            for first in self.alternatives[element[1]]:
                todo.append(below if first is None else below + (first,))
        if len(self.advanced) > 20_000:
            self.advanced.clear()
        found = self.advanced[stack] = tuple(out)
        return found

    def matches(self, stack: Stack, point: int) -> bool:
        if not stack:
            return False
        _, positive, ranges = self.elements[stack[-1]]
        return any(low <= point <= high for low, high in ranges) == positive

    def walk(self, state: GrammarState, piece: bytes) -> tuple[int, Optional[GrammarState]]:
        """A token with text ``piece`` in ``state``: the steps llama.cpp takes to check it
        (walks down every stack, none merged), and the state after it, or None if the grammar
        refuses it. Raises GrammarLimit past GRAMMAR_PATHS steps or GRAMMAR_STACKS stacks."""
        stacks, partial = state
        points, partial = grammar_code_points(piece, partial)
        if partial[1] < 0:
            return len(stacks), None
        result: dict[Stack, None] = {}
        steps = len(stacks)
        for stack in stacks:
            current = {stack: 1} if stack or not points else {}
            for point in points:
                following: dict[Stack, int] = {}
                for each, walks in current.items():
                    if self.matches(each, point):
                        for after in self._pop(each):
                            following[after] = following.get(after, 0) + walks
                steps += sum(following.values())
                if steps > GRAMMAR_PATHS:
                    raise GrammarLimit(f"too ambiguous: checking one token took more than {GRAMMAR_PATHS:,} "
                                       "parse steps")
                current = following
                if not current:
                    break
            result.update(dict.fromkeys(current))
        if len(result) > GRAMMAR_STACKS:
            raise GrammarLimit(f"too ambiguous: {len(result):,} ways to parse the text so far are open at "
                               f"once (the limit is {GRAMMAR_STACKS:,})")
        # Where the token ends, a stack takes it if the grammar is complete there and no
        # character is left half done, or if its class can hold the character half done
        # (llama.cpp keeps every stack all the same)
        if not any(self._may_end(stack, partial) for stack in result):
            return steps, None
        return steps, (frozenset(result), partial)

    def _may_end(self, stack: Stack, partial: tuple[int, int]) -> bool:
        """llama_grammar_match_partial_char, and the empty stack's case."""
        value, remain = partial
        if remain == 0:
            return True
        if not stack or (remain == 1 and value < 2):
            return False
        low = value << (remain * 6)
        high = low | ((1 << (remain * 6)) - 1)
        if low == 0:
            low = {2: 1 << 11, 3: 1 << 16}.get(remain, low)
        _, positive, ranges = self.elements[stack[-1]]
        if any(first <= high and low <= last for first, last in ranges):
            return positive
        return not positive

    def check(self) -> str:
        """Why this grammar is refused at the door ("" if it is not): its start opens more
        than GRAMMAR_STACKS stacks, or a text of GRAMMAR_SUBMIT_CHARS characters from its
        start takes more than GRAMMAR_PATHS steps to check. (What it does later is bounded
        as it happens, by ``walk`` and ``vocab_cost``.)"""
        stacks = self.start[0]
        try:
            if len(stacks) > GRAMMAR_STACKS:
                raise GrammarLimit(f"too wide: {len(stacks):,} ways to parse are open at once "
                                   f"(the limit is {GRAMMAR_STACKS:,})")
            self._paths({stack[-GRAMMAR_COST_DEPTH:]: 1 for stack in stacks}, GRAMMAR_SUBMIT_CHARS,
                        [GRAMMAR_CHECK_WORK], 0)
        except GrammarLimit as err:
            return str(err)
        finally:
            self.costs.clear()  # (only this check uses them; the daemon keeps shapes for long)
        return ""

    def _paths(self, items: dict[Stack, int], depth: int, budget: list[int], spent: int) -> int:
        """The most steps llama.cpp takes to check a text of at most ``depth`` more characters
        from the stacks ``items`` (stack -> walks reaching it), ``spent`` steps into it.
        Raises GrammarLimit once a text passes GRAMMAR_PATHS."""
        budget[0] -= len(items)
        key = (frozenset(items.items()), depth)
        found = self.costs.get(key)
        if found is None:
            total = sum(items.values())
            if spent + total <= GRAMMAR_PATHS:
                worst = 0
                if depth > 0:
                    children = self._children(items, budget, GRAMMAR_COST_DEPTH)[1]
                    for child in {id(child): child for child in children if child}.values():
                        worst = max(worst, self._paths(child, depth - 1, budget, spent + total))
                found = total + worst
                if len(self.costs) > 50_000:
                    self.costs.clear()
                self.costs[key] = found
            else:
                found = total
        if spent + found > GRAMMAR_PATHS:
            raise GrammarLimit(f"too ambiguous: checking a text of {GRAMMAR_SUBMIT_CHARS} characters from its "
                               f"start can take more than {GRAMMAR_PATHS:,} parse steps")
        return found

    def _children(self, items: dict[Stack, int], budget: list[int],
                  cut: Optional[int] = None) -> tuple[list[int], list[dict[Stack, int]]]:
        """The code points the top classes of ``items`` tell apart, as ``edges`` (range i is
        edges[i] to edges[i + 1] - 1), and for each range the stacks (with their walks) a
        character in it leads to (one dict for ranges that lead alike), cut to their top
        ``cut`` elements if given. Charges its work to ``budget``."""
        import bisect

        bounds = {0, 0x110000}
        for stack in items:
            if stack:
                for low, high in self.elements[stack[-1]][2]:
                    bounds.update((low, high + 1))
        edges = sorted(bounds)
        spans = len(edges) - 1
        covered: dict[int, list[Stack]] = {}  # range -> the stacks whose top class holds it
        work = len(items) + len(edges)
        for stack in items:
            if not stack:
                continue
            _, positive, ranges = self.elements[stack[-1]]
            inside: set[int] = set()
            for low, high in ranges:
                inside.update(range(bisect.bisect_left(edges, low), bisect.bisect_left(edges, high + 1)))
            held = inside if positive else set(range(spans)) - inside
            work += len(held) + (0 if positive else spans)
            for index in held:
                covered.setdefault(index, []).append(stack)
        budget[0] -= work
        if budget[0] < 0:
            raise GrammarLimit(f"too ambiguous: counting its work took more than {GRAMMAR_CHECK_WORK:,} steps")
        made: dict[tuple[Stack, ...], dict[Stack, int]] = {}
        children = []
        for index in range(spans):
            matching = tuple(covered.get(index, ()))
            child = made.get(matching)
            if child is None:
                child = made[matching] = {}
                for stack in matching:
                    walks = items[stack]
                    for after in self._pop(stack):
                        if cut is not None:
                            after = after[-cut:]
                        child[after] = child.get(after, 0) + walks
                        work += 1
                budget[0] -= len(matching) + len(child)
            children.append(child)
        if budget[0] < 0:
            raise GrammarLimit(f"too ambiguous: counting its work took more than {GRAMMAR_CHECK_WORK:,} steps")
        return edges, children

    def vocab_cost(self, state: GrammarState, vocab: "GrammarVocab", ids: Any = None) -> tuple[int, int]:
        """The steps llama.cpp takes to check every token of ``vocab`` (or those of ``ids``) in
        ``state``, and the most one token takes: each token's characters walked down every
        stack, none merged, the tokens a character at a time together (numpy). Raises
        GrammarLimit past the limits. The whole vocabulary's cost is remembered per state, and
        bounds any part's: a state asked about a second time is counted whole (a few ms, once;
        a part of 4,096 tokens takes about 0.5 ms each time)."""
        found = self.vocab_costs.get(state)
        if found is not None:
            return found
        if ids is not None and state in self.asked:
            ids = None
        elif ids is not None:
            if len(self.asked) > 4_000:
                self.asked.clear()
            self.asked.add(state)
        total, worst = _VocabWalk(vocab.np, self.splits, self._children).cost(state, vocab, ids)
        if total > GRAMMAR_VOCAB_WORK:
            raise GrammarLimit(f"too wide: checking the vocabulary here takes {total:,} parse steps "
                               f"(the limit is {GRAMMAR_VOCAB_WORK:,})")
        if ids is None:
            if len(self.vocab_costs) > 4_000:
                self.vocab_costs.clear()
            self.vocab_costs[state] = (total, worst)
        return total, worst


# ============================================================================
# 5.6 GBNF grammars
# ============================================================================
# check_grammar and _GbnfParser: a grammar parsed as llama.cpp parses it, bounded in size and
# repetition, into the elements GrammarShape walks. Stateless.


# A grammar job's grammar is parsed here at submit the way llama.cpp parses it
# (src/llama-grammar.cpp: llama_grammar_parser::parse, then llama_grammar_init_impl's checks), so
# that a bad grammar is exit 2 at the door rather than a failed job later.

GRAMMAR_MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
# llama.cpp expands {m,n} into copies of the item, and copies the rules for every job: a
# 32 KB grammar of "<2000 characters>"{2000} took 1.1 GB.
GRAMMAR_MAX_ELEMENTS = 200_000
_GBNF_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_GBNF_HEX = {"x": 2, "u": 4, "U": 8}
_GBNF_NAME = re.compile(r"[A-Za-z0-9-]*")  # a rule name: ASCII letters, digits and '-'


def check_grammar(text: str) -> "GrammarShape":
    """Raise InvalidInput (naming the line and column) unless llama.cpp would accept ``text``
    as a GBNF grammar with a ``root`` rule, and its start is within the work limits
    (GrammarShape.check). Returns its shape."""
    parser = _GbnfParser(text)
    try:
        parser.parse()
    except RecursionError:
        raise InvalidInput("grammar: nested too deeply") from None
    shape = GrammarShape(parser.rules, parser.ids["root"])
    problem = shape.check()
    if problem:
        raise InvalidInput(f"grammar: {problem}")
    return shape


class _GbnfParser:
    """llama.cpp's grammar parser: rules are lists of alternatives, each a list of elements,
    ("ref", rule id) or ("sym", positive, ((low, high), ...)) for a character class (a
    literal's character is a class of one; "." is ("sym", False, ())), as llama.cpp makes them."""

    def __init__(self, text: str) -> None:
        self.src = text
        self.ids: dict[str, int] = {}
        self.rules: dict[int, list[list[tuple[Any, ...]]]] = {}
        self.made: dict[int, str] = {}  # rules the parser makes for (...), *, +, ?, {m,n}
        self.size = 0  # elements the rules will hold once llama.cpp expands the repetitions

    def fail(self, pos: int, message: str) -> None:
        line = self.src.count("\n", 0, pos) + 1
        column = pos - (self.src.rfind("\n", 0, pos) + 1) + 1
        raise InvalidInput(f"grammar: {message} at line {line}, column {column}")

    def char(self, pos: int) -> str:
        return self.src[pos] if pos < len(self.src) else ""

    def space(self, pos: int, newline_ok: bool) -> int:
        src = self.src
        while pos < len(src) and (src[pos] in " \t#" or (newline_ok and src[pos] in "\r\n")):
            if src[pos] == "#":
                while pos < len(src) and src[pos] not in "\r\n":
                    pos += 1
            else:
                pos += 1
        return pos

    def name(self, pos: int) -> int:
        end = _GBNF_NAME.match(self.src, pos).end()  # type: ignore[union-attr]
        if end == pos:
            self.fail(pos, "expecting a rule name")
        return end

    def symbol(self, name: str) -> int:
        return self.ids.setdefault(name, len(self.ids))

    def new_symbol(self, base: str) -> int:
        rule_id = len(self.ids)
        self.ids[f"{base}_{rule_id}"] = rule_id
        self.made[rule_id] = f"a group or repetition in rule {base!r}"
        return rule_id

    def parse_char(self, pos: int) -> tuple[int, int]:
        """The code point a character of a literal or a class stands for, and where it ends."""
        src = self.src
        if pos >= len(src):
            self.fail(pos, "unexpected end of input")
        if src[pos] != "\\":
            value, end = ord(src[pos]), pos + 1
        else:
            code = self.char(pos + 1)
            if code in _GBNF_HEX:
                size = _GBNF_HEX[code]
                digits = src[pos + 2:pos + 2 + size]
                if len(digits) != size or any(c not in "0123456789abcdefABCDEF" for c in digits):
                    self.fail(pos, f"expecting {size} hex digits after \\{code}")
                value, end = int(digits, 16), pos + 2 + size
            elif code in _GBNF_ESCAPES:
                value, end = ord(_GBNF_ESCAPES[code]), pos + 2
            else:
                self.fail(pos, f"unknown escape \\{code}")
        # llama.cpp matches code points decoded from the model's UTF-8, which holds neither
        # (it would accept the grammar, then end a job with U+FFFD where the character was)
        if 0xD800 <= value <= 0xDFFF:
            self.fail(pos, f"U+{value:04X} is a surrogate, which UTF-8 text never holds")
        if value > 0x10FFFF:
            self.fail(pos, f"U+{value:X} is beyond U+10FFFF, the last code point")
        return value, end

    def parse(self) -> None:
        pos = self.space(0, True)
        while pos < len(self.src):
            pos = self.rule(pos)
        for rule_id in range(len(self.ids)):
            if rule_id not in self.rules:
                name = next(n for n, i in self.ids.items() if i == rule_id)
                raise InvalidInput(f"grammar: rule {name!r} is used but never defined")
        if "root" not in self.ids:
            raise InvalidInput("grammar: there is no 'root' rule (generation starts there)")
        cycle = self.left_recursion()
        if cycle is not None:
            names = {i: f"rule {n!r}" for n, i in self.ids.items()}
            raise InvalidInput(f"grammar: {self.made.get(cycle) or names[cycle]} can reach itself without "
                               "consuming anything (left recursion: llama.cpp would loop on it)")

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.src[pos:end]
        rule_id = self.symbol(name)
        pos = self.space(end, False)
        if not self.src.startswith("::=", pos):
            self.fail(pos, "expecting ::=")
        pos = self.alternates(self.space(pos + 3, True), name, rule_id, False)
        if self.char(pos) == "\r":
            pos += 2 if self.char(pos + 1) == "\n" else 1
        elif self.char(pos) == "\n":
            pos += 1
        elif pos < len(self.src):
            self.fail(pos, "expecting a newline or the end")
        return self.space(pos, True)

    def alternates(self, pos: int, name: str, rule_id: int, nested: bool) -> int:
        alternatives: list[list[tuple[Any, ...]]] = []
        pos = self.sequence(pos, name, alternatives, nested)
        while self.char(pos) == "|":
            pos = self.sequence(self.space(pos + 1, True), name, alternatives, nested)
        self.rules[rule_id] = alternatives
        return pos

    def sequence(self, pos: int, name: str, alternatives: list[list[tuple[Any, ...]]], nested: bool) -> int:
        seq: list[tuple[Any, ...]] = []
        last = 0  # where the last item starts in seq (an item may add no element: "", [])
        prev_rules = 1
        src = self.src
        while pos < len(src):
            c = src[pos]
            if c == '"':
                pos += 1
                last, prev_rules = len(seq), 1
                while self.char(pos) != '"':
                    value, pos = self.parse_char(pos)
                    seq.append(("sym", True, ((value, value),)))
                pos = self.space(pos + 1, nested)
            elif c == "[":
                last, prev_rules = len(seq), 1
                pos = self.char_class(pos + 1, nested, seq)
            elif c in "<!":
                pos = self.token(pos + (c == "!"))
                last, prev_rules = len(seq), 1
                pos = self.space(pos, nested)
            elif c.isascii() and (c.isalnum() or c == "-"):
                end = self.name(pos)
                last, prev_rules = len(seq), 1
                seq.append(("ref", self.symbol(src[pos:end])))
                pos = self.space(end, nested)
            elif c == "(":
                before = len(self.ids)
                sub = self.new_symbol(name)
                pos = self.alternates(self.space(pos + 1, True), name, sub, True)
                prev_rules = max(1, len(self.ids) - before)
                last = len(seq)
                seq.append(("ref", sub))
                if self.char(pos) != ")":
                    self.fail(pos, "expecting ')'")
                pos = self.space(pos + 1, nested)
            elif c == ".":
                last, prev_rules = len(seq), 1
                seq.append(("sym", False, ()))  # no character excluded: any
                pos = self.space(pos + 1, nested)
            elif c in "*+?{":
                pos, prev_rules = self.repeat(pos, name, seq, last, prev_rules, nested)
            else:
                break
        alternatives.append(seq)
        return pos

    def char_class(self, pos: int, nested: bool, seq: list[tuple[Any, ...]]) -> int:
        """The character class starting at ``pos`` (after its "["), added to ``seq``; where the
        parse goes on."""
        positive = self.char(pos) != "^"
        pos += not positive
        ranges: list[tuple[int, int]] = []
        while self.char(pos) != "]":
            low, pos = self.parse_char(pos)
            high = low
            if self.char(pos) == "-" and self.char(pos + 1) not in ("]", ""):
                high, pos = self.parse_char(pos + 1)
            elif self.char(pos) == "-" and self.char(pos + 1) == "":
                self.fail(pos, "unexpected end of input")
            ranges.append((low, high))
        if ranges:  # llama.cpp turns "[]" into nothing at all
            seq.append(("sym", positive, tuple(ranges)))
        return self.space(pos + 1, nested)

    def repeat(self, pos: int, name: str, seq: list[tuple[Any, ...]], last: int, prev_rules: int,
               nested: bool) -> tuple[int, int]:
        """The repetition (*, +, ?, {m,n}) at ``pos`` of ``seq``'s last item (from ``last``, which
        makes ``prev_rules`` rules), written into ``seq`` as llama.cpp writes it: (where the parse
        goes on, the rules the repeated item makes)."""
        low, high, pos = self.repetition(pos, nested)
        if last == len(seq):
            self.fail(pos, "expecting an item before */+/?/{")
        total = high if high is not None and high > 0 else (low if low > 0 else 1)
        if prev_rules * total > GRAMMAR_MAX_REPETITION:
            self.fail(pos, f"repetition makes more than {GRAMMAR_MAX_REPETITION} rules")
        item = seq[last:]
        self.size += len(item) * max(low, high or 1)
        if self.size > GRAMMAR_MAX_ELEMENTS:
            self.fail(pos, f"the grammar expands to more than {GRAMMAR_MAX_ELEMENTS:,} elements "
                           "(each copy of a repeated item counts)")
        del seq[last:]
        seq += item * low
        # The optional repetitions as llama.cpp writes them (their shape decides how
        # many parse stacks a step holds, which GrammarShape counts): S{m,} adds
        # S' ::= S S' | and S{m,n} a chain S'(k) ::= S S'(k-1) | ... S'(1) ::= S |
        optional = None
        for _ in range(1 if high is None else high - low):
            rule_id = self.new_symbol(name)
            tail = [("ref", rule_id if high is None else optional)] if high is None or optional is not None else []
            self.rules[rule_id] = [item + tail, []]
            optional = rule_id
        if optional is not None:
            seq.append(("ref", optional))
        return pos, prev_rules * total

    def repetition(self, pos: int, nested: bool) -> tuple[int, Optional[int], int]:
        c = self.src[pos]
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c] + (self.space(pos + 1, nested),)
        pos = self.space(pos + 1, nested)
        start = pos
        while self.char(pos) and self.char(pos) in "0123456789":
            pos += 1
        if pos == start:
            self.fail(pos, "expecting an integer")
        if pos - start > 9:
            self.fail(start, "a repetition count that large is not supported")
        low, high = int(self.src[start:pos]), None
        pos = self.space(pos, nested)
        if self.char(pos) == "}":
            high = low
        elif self.char(pos) == ",":
            pos = self.space(pos + 1, nested)
            start = pos
            while self.char(pos) and self.char(pos) in "0123456789":
                pos += 1
            if pos - start > 9:
                self.fail(start, "a repetition count that large is not supported")
            if pos > start:
                high = int(self.src[start:pos])
                pos = self.space(pos, nested)
            if self.char(pos) != "}":
                self.fail(pos, "expecting '}'")
        else:
            self.fail(pos, "expecting ',' or '}'")
        if low > GRAMMAR_MAX_REPETITION:
            self.fail(pos, f"more than {GRAMMAR_MAX_REPETITION} repetitions")
        if high is not None and high > GRAMMAR_MAX_REPETITION:
            high = None
        if high is not None and high < low:
            self.fail(pos, f"{{{low},{high}}}: the most is less than the least")
        return low, high, self.space(pos + 1, nested)

    def token(self, pos: int) -> int:
        # llama.cpp checks a token element against the token's ID alone, so after characters
        # in the same rule it lets a longer token through ("a" <[369]> takes "ab"), and then
        # aborts the whole process when it accepts it: token elements are refused.
        self.fail(pos, "token elements (<...>, <[id]>, !<...>) are not supported: write the text in quotes")
        return pos

    def left_recursion(self) -> Optional[int]:
        """A rule that can reach itself before consuming a character, if any.

        Stricter than llama.cpp, on purpose: its check counts a rule as possibly empty only
        when one of its alternatives is written empty, so ``x ::= ws x`` with ``ws ::= [ ]*``
        passes it, and then building the grammar recurses without end until the daemon dies."""
        # A rule is nullable if an alternative is nothing but nullable rules: each such
        # alternative waits for its rules, once each (a pass over every rule until nothing
        # changed took as many passes as the longest chain: seconds for a schema's patterns).
        waiting: dict[int, list[list[Any]]] = {}  # rule -> the alternatives that wait for it
        ready = []
        for rule_id, alternatives in self.rules.items():
            for alt in alternatives:
                if all(e[0] == "ref" for e in alt):
                    refs = {e[1] for e in alt}
                    entry = [rule_id, len(refs)]  # the rules it still waits for
                    for ref in refs:
                        waiting.setdefault(ref, []).append(entry)
                    if not refs:
                        ready.append(rule_id)
        nullable: set[int] = set()
        while ready:
            rule_id = ready.pop()
            if rule_id in nullable:
                continue
            nullable.add(rule_id)
            for entry in waiting.get(rule_id, ()):
                entry[1] -= 1
                if not entry[1]:
                    ready.append(entry[0])
        leading: dict[int, list[int]] = {}  # rule -> the rules it may start with
        for rule_id, alternatives in self.rules.items():
            starts = leading[rule_id] = []
            for alt in alternatives:
                for element in alt:
                    if element[0] != "ref":
                        break
                    starts.append(element[1])
                    if element[1] not in nullable:
                        break
        state: dict[int, int] = {}  # 1: on the current path, 2: explored
        for root in self.rules:
            if root in state:
                continue
            stack = [(root, iter(leading[root]))]
            state[root] = 1
            while stack:
                rule_id, successors = stack[-1]
                for successor in successors:
                    if state.get(successor) == 1:
                        return successor
                    if successor not in state:
                        state[successor] = 1
                        stack.append((successor, iter(leading[successor])))
                        break
                else:
                    state[rule_id] = 2
                    stack.pop()
        return None


# ============================================================================
# 5.7 JSON schemas
# ============================================================================
# check_json_schema walks a schema in the converter's order and refuses what the converter would
# drop; _schema_branch is the one rule of which keywords decide a branch, used here and by the
# daemon's converter (11.2). Stateless.


# Keywords that only annotate: no validator looks at them, so dropping them loses nothing.
SCHEMA_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                                "readOnly", "writeOnly", "$schema", "$id", "$defs", "definitions"})
SCHEMA_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
SCHEMA_MAX_DEPTH = 64
SCHEMA_MAX_PROPERTIES = 256  # the converter recurses once per optional property
# A schema's patterns and formats together, counted as one pattern's are (_pattern_shape): the
# steps their automata take to make (each distinct one once) and the grammar states they become
# (each use: each is a copy of its rules). Ten patterns of 1.5 million steps each passed the
# per-pattern limits, and then took a minute to check and convert on a worker.
SCHEMA_MAX_PATTERN_WORK = 3_000_000
SCHEMA_MAX_PATTERN_STATES = 40_000
def check_json_schema(schema: Any) -> None:
    """Raise InvalidInput unless the grammar converter honours every keyword of ``schema``
    (naming the keyword and where it is, as a JSON pointer)."""
    check = _SchemaCheck(schema)
    check.visit(schema, "", 0)
    for key in ("$defs", "definitions"):  # every definition, used or not: the converter reads them all
        if isinstance(schema, dict) and isinstance(schema.get(key), dict):
            for name in schema[key]:
                check.ref(f"#/{key}/{name}", f"/{key}/{name}", 1, ())
    check.loops()
    check.stray_refs(schema, "")


def _schema_branch(node: Mapping[str, Any]) -> str:
    """The branch a schema object takes, in the order llama_cpp.llama_grammar.SchemaConverter.visit
    tests them, with nrvna's own in its place (type lists, bounds and multipleOf, patterns and
    formats). The one place the order is decided: _SchemaCheck.visit checks each branch's
    keywords and the daemon's converter (_converter_class) writes the same branch, so a new
    keyword is one edit here. One of: "ref", "oneOf", "anyOf", "types" (a list of types),
    "constants", "object", "allOf", "array", "pattern" (or format), "string", "number",
    "bare object" (an object without properties, or {}), "untyped", "other" (boolean, null,
    an array without items)."""
    kind = node.get("type")
    if "$ref" in node:
        return "ref"
    if "oneOf" in node:
        return "oneOf"
    if "anyOf" in node:
        return "anyOf"
    if isinstance(kind, list):
        return "types"
    if "const" in node or "enum" in node:
        return "constants"
    if kind in (None, "object") and ("properties" in node or (
            "additionalProperties" in node and node["additionalProperties"] is not True)):
        return "object"
    if "allOf" in node:
        return "allOf"
    if kind in (None, "array") and ("items" in node or "prefixItems" in node):
        return "array"
    if kind in (None, "string") and ("pattern" in node or "format" in node):
        return "pattern"
    if kind == "string":
        return "string"
    if kind in ("integer", "number"):
        return "number"
    if kind == "object" or not node:
        return "bare object"
    return "untyped" if kind is None else "other"


def _json_type_is(value: Any, kind: str) -> bool:
    """Whether a JSON value is of a JSON Schema type."""
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float))
    return isinstance(value, {"string": str, "null": type(None), "object": dict, "array": list, "boolean": bool}[kind])


class _SchemaCheck:
    """One walk of a schema, taking the branches _schema_branch names: a branch of the converter
    honours some keywords and silently drops the rest, so each refuses what its branch drops."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.refs_seen: set[str] = set()
        self.ref_nodes: set[int] = set()  # the $ref objects visited as schemas
        self.leads: dict[str, set[str]] = {}  # $ref -> the $refs its schema may start with
        self.pattern_work: dict[str, int] = {}  # pattern (or format's pattern) -> its automaton's steps
        self.pattern_states = 0  # grammar states of every pattern and format, each use counted

    def fail(self, where: str, message: str) -> None:
        raise InvalidInput(f"schema {where or '/'}: {message}")

    def only(self, node: dict[str, Any], where: str, allowed: Iterable[str], branch: str) -> None:
        for key in node:
            if key in SCHEMA_ANNOTATIONS or key in allowed or key.startswith("x-"):
                continue
            self.fail(where, f"keyword {key!r} is not supported{' ' + branch if branch else ''} "
                             "(the grammar would not enforce it)")

    def visit(self, node: Any, where: str, depth: int, entered: tuple[str, ...] = ()) -> None:
        # entered: the $refs followed since the last object or array, which consume
        # a character before their parts: one of them again is a loop on nothing.
        if depth > SCHEMA_MAX_DEPTH:
            self.fail(where, f"nested more than {SCHEMA_MAX_DEPTH} levels deep")
        if not isinstance(node, dict):
            self.fail(where, "a schema must be a JSON object (true/false schemas are not supported)")
        kind = node.get("type")
        if kind is not None and not isinstance(kind, (str, list)):
            self.fail(where, "type must be a string or a list of strings")
        if isinstance(kind, str) and kind not in SCHEMA_TYPES:
            self.fail(where, f"unknown type {kind!r} (known: {', '.join(SCHEMA_TYPES)})")
        branch = _schema_branch(node)
        if branch == "ref":
            self.ref_nodes.add(id(node))
            self.only(node, where, ("$ref",), "beside $ref")
            if where and ("$defs" in node or "definitions" in node):  # the converter would not see into them
                self.fail(where, "$defs beside $ref is supported at the top of the schema only")
            self.ref(node["$ref"], where, depth, entered)
        elif branch == "oneOf":
            self.fail(where, "keyword 'oneOf' is not supported: the grammar would enforce it as anyOf (an output "
                             "matching two alternatives breaks oneOf); write anyOf where they cannot overlap")
        elif branch == "anyOf":
            key = "anyOf"
            self.only(node, where, (key,), f"beside {key} (put it in each alternative)")
            choices = node[key]
            if not isinstance(choices, list) or not choices:
                self.fail(where, f"{key} must be a non-empty list of schemas")
            for i, choice in enumerate(choices):
                self.visit(choice, f"{where}/{key}/{i}", depth + 1, entered)
        elif branch == "types":
            self.type_list(node, where, depth, entered)
        elif branch == "constants":
            self.constants(node, where, kind)
        elif branch == "object":
            self.object(node, where, depth)
        elif branch == "allOf":
            self.fail(where, "keyword 'allOf' is not supported (merge the schemas into one)")
        elif branch == "array":
            self.array(node, where, depth)
        elif branch == "pattern":
            self.pattern(node, where)
        elif branch == "string":
            self.only(node, where, ("type", "minLength", "maxLength"), "for a string")
            self.counts(node, where, "minLength", "maxLength")
        elif branch == "number":
            self.only(node, where, ("type",) + SCHEMA_TYPE_KEYWORDS[kind],
                      f"for {'an integer' if kind == 'integer' else 'a number'}")
            if any(key in node for key in SCHEMA_TYPE_KEYWORDS[kind]):
                number_rule(node, where, {})  # raises InvalidInput when nothing is admitted, or too much is needed
        elif branch == "bare object":
            self.only(node, where, ("type", "additionalProperties"), "for an object without properties")
        elif branch == "untyped":
            self.only(node, where, (), "")
            self.fail(where, "a schema needs a type (or properties, items, enum, const, $ref, anyOf)")
        else:
            allowed = ("type",)
            self.only(node, where, allowed, f"for {kind}" + (" without items" if kind == "array" else ""))

    def pattern(self, node: dict[str, Any], where: str) -> None:
        """A string with a pattern or a format: nrvna writes its rule in the converter's place."""
        self.only(node, where, ("type",) + SCHEMA_TYPE_KEYWORDS["string"], "beside pattern or format")
        self.counts(node, where, "minLength", "maxLength")
        rules: dict[str, str] = {}
        expression = string_rule(node, where, rules)
        self.count_pattern(node, where)
        if "pattern" in node:  # what llama.cpp is given must not hang a worker: checked as a grammar is
            try:
                check_grammar(f'root ::= "\\"" {expression} "\\""\n' + "".join(f"{n} ::= {b}\n" for n, b in rules.items()))
            except InvalidInput as err:
                self.fail(where, f"pattern {node['pattern']!r} makes a grammar nrvna refuses ({err})")

    def type_list(self, node: dict[str, Any], where: str, depth: int, entered: tuple[str, ...]) -> None:
        kind = node["type"]
        if not kind or not all(isinstance(t, str) and t in SCHEMA_TYPES for t in kind) or len(set(kind)) < len(kind):
            self.fail(where, f"type must be one of {', '.join(SCHEMA_TYPES)} or a list of distinct ones")
        if "const" in node or "enum" in node:
            self.constants(node, where, kind)
            return
        self.only(node, where, ("type",) + tuple(key for t in kind for key in SCHEMA_TYPE_KEYWORDS[t]),
                  f"for any of the types {', '.join(kind)}")
        for choice in type_choices(node):  # as an anyOf of one schema per type
            self.visit(choice, where, depth + 1, entered)

    def ref(self, ref: Any, where: str, depth: int, entered: tuple[str, ...]) -> None:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            self.fail(where, f"$ref {ref!r} is not supported (only local references, '#/...')")
        if ref in entered:
            self.fail(where, f"$ref {ref!r} refers back to itself before any object or array (a loop on nothing)")
        if entered:
            self.leads.setdefault(entered[-1], set()).add(ref)
        if ref in self.refs_seen:
            return  # recursive schemas are fine: the grammar refers to the rule again
        self.refs_seen.add(ref)
        target = self.root
        for part in ref[2:].split("/"):  # as the converter resolves it: no ~0/~1 unescaping
            if not isinstance(target, dict) or part not in target:
                self.fail(where, f"$ref {ref!r} points at nothing")
            target = target[part]
        self.visit(target, ref[1:], depth + 1, entered + (ref,))

    def loops(self) -> None:
        """A $ref that leads back to itself through others before any object or array."""
        state: dict[str, int] = {}

        def walk(ref: str) -> None:
            state[ref] = 1
            for nxt in self.leads.get(ref, ()):
                if state.get(nxt) == 1:
                    self.fail(nxt[1:], f"$ref {nxt!r} refers back to itself before any object or array (a loop on nothing)")
                if nxt not in state:
                    walk(nxt)
            state[ref] = 2

        for ref in list(self.leads):
            if ref not in state:
                walk(ref)

    def stray_refs(self, node: Any, where: str) -> None:
        """A "$ref" key anywhere else (a value in enum, const or default, a property named
        $ref): the converter would try to resolve it."""
        if isinstance(node, dict):
            if "$ref" in node and id(node) not in self.ref_nodes:
                self.fail(where, "a '$ref' key where no schema is (in a value, or a property named $ref) is not supported")
            for key, value in node.items():
                self.stray_refs(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                self.stray_refs(value, f"{where}/{i}")

    def constants(self, node: dict[str, Any], where: str, kind: Any) -> None:
        key = "const" if "const" in node else "enum"
        self.only(node, where, (key, "type"), f"beside {key}")
        values = [node["const"]] if key == "const" else node["enum"]
        if key == "enum" and (not isinstance(values, list) or not values):
            self.fail(where, "enum must be a non-empty list")
        kinds = kind if isinstance(kind, list) else [kind]
        if kind is not None and not all(any(_json_type_is(value, k) for k in kinds) for value in values):
            self.fail(where, f"{key} holds a value that is not of type {kind!r}")

    def object(self, node: dict[str, Any], where: str, depth: int) -> None:
        self.only(node, where, ("type", "properties", "required", "additionalProperties"), "for an object")
        properties = node.get("properties", {})
        if not isinstance(properties, dict):
            self.fail(where, "properties must be an object")
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            self.fail(where, "required must be a list of property names")
        for name in required:
            if name not in properties:
                self.fail(where, f"required property {name!r} is not in properties")
        if len(properties) > SCHEMA_MAX_PROPERTIES:
            self.fail(where, f"more than {SCHEMA_MAX_PROPERTIES} properties")
        for name, sub in properties.items():
            if not name:
                self.fail(where, "a property named '' is not supported")
            self.visit(sub, f"{where}/properties/{name}", depth + 1)
        extra = node.get("additionalProperties")
        if properties and extra not in (None, False):
            # the converter's rule for other keys would admit the declared names too, with any value
            self.fail(where, "additionalProperties other than false beside properties is not supported")
        if isinstance(extra, dict):
            self.visit(extra, f"{where}/additionalProperties", depth + 1)
        elif extra is not None and not isinstance(extra, bool):
            self.fail(where, "additionalProperties must be true, false or a schema")

    def array(self, node: dict[str, Any], where: str, depth: int) -> None:
        items, prefix = node.get("items"), node.get("prefixItems")
        if isinstance(items, dict):
            if not items:  # the converter reads {} as "no items" and fails
                self.fail(where, "items {} is not supported: give the items' type")
            if prefix is not None:
                self.fail(where, "give items or prefixItems, not both")
            self.only(node, where, ("type", "items", "minItems", "maxItems"), "for an array")
            self.counts(node, where, "minItems", "maxItems")
            self.visit(items, f"{where}/items", depth + 1)
            return
        # A tuple: "prefixItems" (with "items": false) or the older "items": [...].
        tuple_items = items if isinstance(items, list) else prefix
        if not isinstance(tuple_items, list) or not tuple_items or (items is not None and items is not False
                                                                     and not isinstance(items, list)):
            self.fail(where, "items must be a schema, or prefixItems a non-empty list of schemas")
        self.only(node, where, ("type", "items", "prefixItems"), "for a tuple (prefixItems)")
        key = "items" if isinstance(items, list) else "prefixItems"
        for i, sub in enumerate(tuple_items):
            self.visit(sub, f"{where}/{key}/{i}", depth + 1)

    def count_pattern(self, node: dict[str, Any], where: str) -> None:
        """Add a pattern's or format's work (string_rule has made it) to the schema's, and
        refuse the schema once the total passes SCHEMA_MAX_PATTERN_WORK or _STATES: the
        check here, the conversion in the daemon and llama.cpp's parse grow with them."""
        source = node["pattern"] if "pattern" in node else SCHEMA_FORMATS[node["format"]]
        shape = _pattern_shape(source)  # (remembered: string_rule has just made it)
        self.pattern_work[source] = shape.work
        self.pattern_states += len(shape.states)
        work = sum(self.pattern_work.values())
        if work > SCHEMA_MAX_PATTERN_WORK:
            self.fail(where, f"the schema's patterns and formats take {work:,} steps to make into a grammar with "
                             f"this one, over the {SCHEMA_MAX_PATTERN_WORK:,} a schema may take (this one takes "
                             f"{shape.work:,}): use fewer or simpler patterns")
        if self.pattern_states > SCHEMA_MAX_PATTERN_STATES:
            self.fail(where, f"the schema's patterns and formats make {self.pattern_states:,} grammar states with "
                             f"this one, over the {SCHEMA_MAX_PATTERN_STATES:,} a schema may make (this one makes "
                             f"{len(shape.states):,}; each count of a counted repetition is a state)")

    def counts(self, node: dict[str, Any], where: str, low_key: str, high_key: str) -> None:
        low, high = node.get(low_key, 0), node.get(high_key)
        for key, value in ((low_key, low), (high_key, high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= SCHEMA_MAX_REPEAT):
                self.fail(where, f"{key} must be an integer from 0 to {SCHEMA_MAX_REPEAT}")
        if high is not None and low > high:
            self.fail(where, f"{low_key} {low} is more than {high_key} {high}")


# ============================================================================
# 5.8 Tool calls
# ============================================================================
# The tools a job may call, as OpenAI gives them: the one schema a call is held to, the grammar
# around it (a template's markers), the stated generic rendering for templates with no tool
# section, and the calls read back from a model's text. Pure and stateless: any thread.


TOOLS_MAX = 128  # OpenAI's limit of tools a request may give
TOOL_CHOICES = ("none", "auto", "required")
_TOOL_TEXT = ((0x01, 0xD7FF), (0xE000, _LAST_POINT))  # what free text may hold (no NUL, no surrogate)
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a schema's or a tool's name


class ToolFormat(namedtuple("ToolFormat", "open close")):
    """How a model writes a call. A template with a tool section writes each call as
    ``OPEN {"name": ..., "arguments": {...}} CLOSE`` (Hermes' and Qwen's ``<tool_call>``); the
    generic form (``open`` empty) is nrvna's own for templates with none: the whole answer is
    one JSON object, ``{"tool_call": {...}}``, ``{"tool_calls": [...]}`` or ``{"response": "..."}``."""

    __slots__ = ()

    @property
    def generic(self) -> bool:
        return not self.open


GENERIC_TOOLS = ToolFormat("", "")


def tool_choice_name(choice: Any) -> Optional[str]:
    """The function a named tool_choice names (``{"type": "function", "function": {"name"}}``), else None."""
    return choice["function"]["name"] if isinstance(choice, dict) else None


def _hoisted(parameters: Mapping[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as a definition of the composed schema: its own ``$defs`` (and
    ``definitions``) moved into ``defs`` under ``prefix-NAME`` and its references rewritten to
    them (a reference is resolved from the document's root, which is no longer the tool's)."""
    import json

    own = {key: value for key, value in parameters.items() if key not in ("$defs", "definitions")}
    renames = {"#": f"#/$defs/{prefix}"}
    for key in ("$defs", "definitions"):
        for name in parameters.get(key) or {}:
            renames[f"#/{key}/{name}"] = f"#/$defs/{prefix}-{name}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (renames.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key in ("$defs", "definitions"):
        for name, definition in (parameters.get(key) or {}).items():
            defs[f"{prefix}-{name}"] = rewrite(definition)
    defs[prefix] = rewrite(json.loads(json.dumps(own)))
    return {"$ref": f"#/$defs/{prefix}"}


def tool_call_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool, form: ToolFormat) -> dict[str, Any]:
    """The JSON schema a call is held to: ``{"name": one of the tools (or the named one),
    "arguments": that tool's parameters}``; in the generic form, the whole answer's (a call,
    several under ``tool_calls`` where parallel, or with ``auto`` a ``response`` instead)."""
    named = tool_choice_name(choice)
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if named is not None and function["name"] != named:
            continue
        arguments = _hoisted(function.get("parameters") or {"type": "object", "properties": {}}, f"t{i}", defs)
        calls.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if form.generic:
        key, value = ("tool_calls", {"type": "array", "items": schema, "minItems": 1}) if parallel else ("tool_call", schema)
        schema = {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}
        if choice == "auto":
            answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                      "additionalProperties": False}
            schema = {"anyOf": [schema, answer]}
    return dict(schema, **{"$defs": defs})


def tool_grammar(call_rules: str, call_rule: str, choice: Any, parallel: bool, form: ToolFormat) -> str:
    """A template's grammar around the call's rules (``call_rules``, rooted at ``call_rule``):
    ``required`` and a named choice begin with the call marker; ``auto`` lets text come first,
    text that never spells the marker unless a whole call follows it (each state a rule: how
    much of the marker the text now ends with), so a call, once begun, is held from its first
    token. Several calls where ``parallel``."""
    block = f"{_gbnf_literal(form.open)} tool-ws {call_rule} tool-ws {_gbnf_literal(form.close)}"
    calls = "tool-block (tool-ws tool-block)*" if parallel else "tool-block"
    # The converter's space is one blank at most; templates put a newline around a call.
    rules = [f"tool-block ::= {block}", f"tool-calls ::= {calls}", 'tool-ws ::= [ \\n]{0,2}']
    if choice != "auto":
        return "\n".join(["root ::= tool-calls"] + rules) + "\n" + call_rules
    marker = form.open
    for k in range(len(marker)):  # text-k: the text so far ends with marker[:k], and no earlier marker
        moves = [f"{_gbnf_literal(marker[k])} {'text-' + str(k + 1) if k + 1 < len(marker) else 'tool-rest'}"]
        seen = {marker[k]}
        for c in dict.fromkeys(marker):
            if c not in seen:  # another of the marker's characters: how much of it the text now ends with
                tail = marker[:k] + c
                j = next(j for j in range(len(tail), -1, -1) if marker.startswith(tail[len(tail) - j:]))
                moves.append(f"{_gbnf_literal(c)} text-{j}")
                seen.add(c)
        others = _spans_and(_TOOL_TEXT, _spans_not(_spans((ord(c), ord(c)) for c in seen)))
        moves.append(f"{_gbnf_class(others)} text-0")
        rules.append(f"text-{k} ::= ({' | '.join(moves)})?")
    rules.append(f"tool-rest ::= tool-ws {call_rule} tool-ws {_gbnf_literal(form.close)}"
                 + (" (tool-ws tool-block)*" if parallel else ""))
    return "\n".join(["root ::= text-0"] + rules) + "\n" + call_rules


def generic_tool_text(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> str:
    """The system text the generic form adds: the tools as JSON, the answer's form and an example
    of it (after llama.cpp's former generic format)."""
    import json

    functions = [tool["function"] for tool in tools]
    call = {"name": "tool_name", "arguments": {"arg1": "some_value"}}
    example = {"tool_calls": [call]} if parallel else {"tool_call": call}
    key = "tool_calls" if parallel else "tool_call"
    named = tool_choice_name(choice)
    how = (f"Respond in JSON format, either with `{key}` (a request to call tools) or with `response` (your reply "
           f"to the user's request)" if choice == "auto" else f"Respond in JSON format with `{key}` (a request to "
           f"call {'the tool ' + named if named else 'tools'})")
    return (f"You can call any of the following tools to satisfy the user's requests: {json.dumps(functions, indent=2, ensure_ascii=False)}"
            f"\n\nExample tool call syntax:\n\n{json.dumps(example, indent=2)}\n\n{how}.")


def generic_messages(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], choice: Any,
                     parallel: bool) -> list[dict[str, str]]:
    """Turns for a template with no tool section: the tools' text in the system message (none
    with ``tool_choice`` none), an assistant's calls and a tool's answers as JSON text."""
    import json

    out: list[dict[str, str]] = []
    for turn in messages:
        if turn["role"] == "tool":
            answer = {"tool_response": {"tool_call_id": turn["tool_call_id"], "content": turn["content"]}}
            if turn.get("name"):
                answer["tool_response"]["tool"] = turn["name"]
            out.append({"role": "user", "content": json.dumps(answer, indent=2, ensure_ascii=False)})
        elif turn.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]), "id": c["id"]}
                     for c in turn["tool_calls"]]
            said = {"tool_calls": calls, **({"content": turn["content"]} if turn.get("content") else {})}
            out.append({"role": "assistant", "content": json.dumps(said, indent=2, ensure_ascii=False)})
        else:
            out.append({"role": turn["role"], "content": turn["content"] or ""})
    if tools and choice != "none":
        text = generic_tool_text(tools, choice, parallel)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _check_tools(value: Any, param: Param) -> list[dict[str, Any]]:
    """OpenAI's tools: functions, each with a name, a description and parameters (a JSON schema
    the converter honours whole, as response_format's; none: no arguments)."""
    import json

    if not isinstance(value, list) or not 1 <= len(value) <= TOOLS_MAX:
        raise InvalidInput(f"tools must be a list of 1 to {TOOLS_MAX} tools")
    names = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidInput(f"{where}.type {kind!r} is not supported (function only)")
        function = tool.get("function")
        if set(tool) != {"type", "function"} or not isinstance(function, dict):
            raise InvalidInput(f'{where} must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}')
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise InvalidInput(f"{where}.function: unknown field {sorted(unknown)[0]!r}")
        name = function.get("name")
        if not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
            raise InvalidInput(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise InvalidInput(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if not isinstance(function.get("description", ""), str) or function.get("strict") not in (None, True, False):
            raise InvalidInput(f"{where}.function: description must be a string and strict true or false")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidInput(f"{where}.function.parameters must be a JSON Schema object")
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        size = len(text.encode("utf-8"))
    except ValueError:
        raise InvalidInput("tools hold a number that is not finite") from None
    except UnicodeEncodeError:
        raise InvalidInput("tools are not valid Unicode (a lone surrogate)") from None
    if size > param.high:
        raise InvalidInput(f"tools are {size} bytes as JSON; the limit is {param.high}")
    if "\x00" in text:
        raise InvalidInput("tools contain a NUL byte")

    def check() -> None:
        for i, tool in enumerate(value):
            try:
                check_json_schema(tool["function"].get("parameters", {"type": "object"}))
            except InvalidInput as err:
                raise InvalidInput(f"tools[{i}].function.parameters: {err}") from None
        try:  # the schemas together, as the daemon composes them (a reference must still resolve)
            check_json_schema(tool_call_schema(value, "auto", True, GENERIC_TOOLS))
        except InvalidInput as err:
            raise InvalidInput(f"tools: {err}") from None

    _checked(("tools", text), check)
    return value


def _check_tool_choice(value: Any, param: Param) -> Any:
    """none, auto, required, or ``{"type": "function", "function": {"name": NAME}}``."""
    if value in TOOL_CHOICES:
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}
            and isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str)):
        raise InvalidInput('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}')
    return value


def _check_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant turn's call, as OpenAI gives it back: ``{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}``."""
    import json

    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(call, dict) and isinstance(call.get("id"), str) and call.get("type", "function") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)):
        raise InvalidInput(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    try:
        json.loads(function["arguments"])
    except (ValueError, RecursionError):
        raise InvalidInput(f"{where}.function.arguments is not JSON text") from None
    text = call["id"] + function["name"] + function["arguments"]
    if "\x00" in text or not text.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") == text:
        raise InvalidInput(f"{where} holds a NUL byte or is not valid Unicode (a lone surrogate)")
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": function["arguments"]}}


def find_tool_format(formatter: Any) -> ToolFormat:
    """How a model's chat template (``formatter``: llama-cpp-python's Jinja2ChatFormatter, or
    None) writes a call, found as llama.cpp finds a template's tool support: an assistant turn
    with one call is rendered, and the tags around the call's JSON (``<tool_call>``...
    ``</tool_call>``) are its markers. A template with no tool section, or another way of
    writing calls, gets the generic form. Called once, at load."""
    import json

    if formatter is None:
        return GENERIC_TOOLS
    tool = {"type": "function", "function": {"name": "nrvna_probe_tool", "description": "a probe",
                                             "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}
    call = {"id": "call_0", "type": "function", "function": {"name": "nrvna_probe_tool", "arguments": {"arg": "value"}}}
    try:
        text = formatter(messages=[{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "", "tool_calls": [call]}], tools=[tool]).prompt
        start = text.index('{"name": "nrvna_probe_tool", "arguments"')
        found, end = json.JSONDecoder().raw_decode(text, start)
    except Exception:  # no call written, not as JSON, or a template that cannot take tools
        found, text, start, end = None, "", 0, 0
    opening = re.search(r"(<[^<>\s]+>)\s*$", text[:start])
    closing = re.match(r"\s*(</[^<>\s]+>)", text[end:])
    if found != {"name": "nrvna_probe_tool", "arguments": {"arg": "value"}} or not (opening and closing) \
            or text.count("nrvna_probe_tool") < 2:  # (the tool's definition is written too)
        log.info("Tool calls: the generic form (the chat template has no tool section nrvna reads)")
        return GENERIC_TOOLS
    form = ToolFormat(opening.group(1), closing.group(1))
    log.info(f"Tool calls: the chat template's, {form.open} ... {form.close}")
    return form


def call_lines(calls: list[dict[str, Any]]) -> str:
    """Calls as result.txt holds them: one compact JSON line each."""
    import json

    return "".join(json.dumps(call, ensure_ascii=False) + "\n" for call in calls)


def tool_call_id(job_id: str, choice: int, k: int) -> str:
    """A call's id: derived from its job (the same after a rerun), unique within the job."""
    return f"call_{job_id}_{k}" if choice == 0 else f"call_{job_id}_c{choice}_{k}"


def read_tool_calls(text: str, form: ToolFormat, job_id: str, choice: int) -> Optional[tuple[Optional[str], list[dict[str, Any]]]]:
    """(content, calls) from a model's answer, or None when it holds no whole call (text only,
    or its first call cut short; a template's calls cut short after whole ones: those). Calls as
    OpenAI gives them: ``{"id", "type": "function", "function": {"name", "arguments": JSON
    text}}``; content None where the answer is calls alone."""
    import json

    found: list[tuple[str, Any]] = []
    content: Optional[str]
    if form.generic:
        try:
            answer = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(answer, dict):
            return None
        if isinstance(answer.get("response"), str) and len(answer) == 1:
            return answer["response"], []
        raw = answer.get("tool_calls") if "tool_calls" in answer else [answer.get("tool_call")]
        content = None
    else:
        start = text.find(form.open)
        if start < 0:
            return None
        content = text[:start].strip() or None
        raw, rest, decoder = [], text[start:], json.JSONDecoder()
        while rest.startswith(form.open):
            body = rest[len(form.open):].lstrip()
            try:
                call, end = decoder.raw_decode(body)
            except (ValueError, RecursionError):
                break  # cut short (max_tokens): the whole calls before it, if any
            rest = body[end:].lstrip()
            if not rest.startswith(form.close):
                break
            raw.append(call)
            rest = rest[len(form.close):].lstrip()
        if rest and not rest.startswith(form.open):
            return None
    for call in raw if isinstance(raw, list) else []:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            return None
        found.append((call["name"], call["arguments"]))
    if not found:
        return None
    return content, [{"id": tool_call_id(job_id, choice, k), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False,
                                                                          separators=(",", ":"))}}
                     for k, (name, arguments) in enumerate(found)]

##############################################################################
# 6. Job parameters: one table (PARAMS) drives validation, submit's flags, the OpenAI Batch mapping,
# the engine's defaults (job_param), --help and the docs
##############################################################################
# Owns PARAMS, the one table of per-job parameters, and the prompt's checks. Invariant: a
# client and a daemon check a job's parameters with the same code. Stateless: any thread.


# Any ID a user may name: hand-made job dirs work, nothing can climb out of the workspace
# (no '/', and a leading '.' is impossible, so '.' and '..' are excluded too).
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# A grammar's limit, and a JSON schema's as compact JSON (their rows in PARAMS). A --json-schema
# file may be indented, so it is read up to 4 times that.
STRUCTURE_LIMIT = 1 << 18


# Most choices one job may ask for (n): as OpenAI's limit, and each is a sequence of a context.
CHOICES_MAX = 128


# Most log-probabilities one job may record, n x max_tokens x (top_logprobs + 1): the daemon holds
# them all until the job ends, and `get --json` reads them whole (n=16, 992 tokens, 20 each took
# 490 MB in a daemon and 479 MB to read back; at this cap, about 10 MB of JSON).
LOGPROBS_MAX = 1 << 17


# The variables the daemon gives a chat template itself (llama-cpp-python's Jinja2ChatFormatter):
# a job's chat_template_kwargs may set any other.
TEMPLATE_VARIABLES = frozenset({"messages", "eos_token", "bos_token", "raise_exception", "add_generation_prompt",
                                "functions", "function_call", "tools", "tool_choice", "strftime_now"})
# reasoning_effort -> the thinking budget it sets, in tokens (low, medium and high are vLLM's;
# none thinks not at all). An explicit thinking_budget_tokens wins over an effort.
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 2048, "high": 8192}
ROLES = ("system", "user", "assistant", "tool")



# Flags that set a job parameter to a fixed value: flag -> (parameter, value, help).
FLAG_SHORTHANDS = {"--json": ("response_format", {"type": "json_object"}, "constrain the output to a JSON object "
                                                                          "(response_format json_object)"),
                   "--no-parallel-tool-calls": ("parallel_tool_calls", False, "at most one tool call a job "
                                                                              "(parallel_tool_calls false)")}


class Endpoint(namedtuple("Endpoint", "input raw object id_prefix")):
    """An OpenAI Batch ``url`` nrvna serves: the body field holding the input (``messages``,
    ``prompt`` or ``input``: texts to embed), whether the prompt skips the chat template, and
    the response object."""

    __slots__ = ()


class Param:
    """One per-job parameter, every field by keyword.

    ``kind`` is the type its JSON value has: ``bool``, ``int``, ``float``, ``str``, ``list``
    (of strings, unless ``check`` says otherwise), ``dict``, or a tuple of the strings it may
    be; ``low``/``high`` its range (for a string or a list, its most bytes or items);
    ``check`` the row's own check for values no type describes (called as ``check(value,
    param)``, returning the value normalized) and ``what`` how the docs name such a value
    (``{low}`` and ``{high}`` filled in). ``default`` is a literal, or None: the daemon's
    setting of the same name in SETTINGS, else unset. ``flag`` is its ``submit`` flag (None:
    none), ``read`` how the flag's argument becomes the value ((metavar, function); None: by
    its type), ``gather`` what a repeated flag's values become (None: a single flag).
    ``openai`` names the OpenAI Batch body fields that carry it (a later one wins),
    ``jsonl`` whether nrvna's JSONL lines may, and ``jobs`` which jobs may carry it:
    "generate", "embed" or "any"."""

    __slots__ = ("kind", "low", "high", "default", "flag", "openai", "jsonl", "help", "read", "gather", "check",
                 "what", "jobs")

    def __init__(self, kind: Any, *, help: str, low: Any = None, high: Any = None, default: Any = None,
                 flag: Optional[str] = None, openai: tuple[str, ...] = (), jsonl: bool = True,
                 read: Optional[tuple[str, Callable[[str], Any]]] = None, gather: Optional[Callable[[list[Any]], Any]] = None,
                 check: Optional[Callable[[Any, "Param"], Any]] = None, what: str = "", jobs: str = "generate") -> None:
        self.kind, self.low, self.high, self.default = kind, low, high, default
        self.flag, self.openai, self.jsonl, self.help = flag, openai, jsonl, help
        self.read, self.gather, self.check, self.what, self.jobs = read, gather, check, what, jobs

    def validate(self, key: str, value: Any) -> Any:
        """``value`` normalized, or InvalidInput naming ``key``."""
        kind, low, high = self.kind, self.low, self.high
        if self.check is not None:
            return self.check(value, self)
        if kind is bool:
            if not isinstance(value, bool):
                raise InvalidInput(f"parameter {key} must be true or false")
        elif kind is str:
            if not isinstance(value, str) or len(value.encode("utf-8", "surrogatepass")) > high:
                raise InvalidInput(f"parameter {key} must be a string of at most {high} bytes")
            if len(value) < (low or 0):  # an empty model name is a part of every model's name
                raise InvalidInput(f"{key} is empty")
            _check_text(key, value)
        elif kind is list:
            if (not isinstance(value, list) or len(value) > high
                    or not all(isinstance(s, str) and s for s in value)):
                raise InvalidInput(f"parameter {key} must be a list of at most {high} non-empty strings")
            for text in value:
                _check_text(key, text)
        elif isinstance(kind, tuple):
            if value not in kind:
                raise InvalidInput(f"parameter {key} must be one of {', '.join(kind)}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (_INF, -_INF):
                raise InvalidInput(f"parameter {key} must be {'an integer' if kind is int else 'a finite number'}")
            if kind is int and value != int(value):
                raise InvalidInput(f"parameter {key} must be an integer")
            value = kind(value)
            if not (low <= value <= high):
                raise InvalidInput(f"parameter {key}={value} is out of range ({low} to {high})")
        return value

    def describe(self) -> str:
        """Its type and range, as the docs' table gives them."""
        if self.what:
            return self.what.format(low=self.low, high=self.high)
        if self.kind is bool:
            return "boolean"
        if self.kind is int:
            return f"integer, {self.low} to {self.high}"
        if self.kind is float:
            return f"number, {self.low:g} to {self.high:g}"
        if self.kind is str:
            return f"string, {f'{self.low} to' if self.low else 'up to'} {self.high} bytes"
        if isinstance(self.kind, tuple):
            return " or ".join(f"`{choice}`" for choice in self.kind)
        return f"list of up to {self.high} strings"


def _read_limited(path: str, limit: int, what: str) -> str:
    """A text file named by a flag, read to at most ``limit`` characters (and so bytes) + 1: a
    longer one is refused unread beyond that (``--grammar /dev/zero`` took gigabytes whole)."""
    import argparse

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(limit + 1)
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    if len(text) > limit:
        raise argparse.ArgumentTypeError(f"{path} is over {limit} bytes, {what}")
    return text


def _read_json_argument(text: str, flag: str) -> tuple[str, Any]:
    """A flag's JSON, given inline (it starts with { or [) or as a file's name (read to 4 times
    STRUCTURE_LIMIT, as an indented file may be): (where it came from, the value)."""
    import argparse
    import json

    source = "the argument"
    if not text.lstrip().startswith(("{", "[")):
        source = text
        text = _read_limited(text, 4 * STRUCTURE_LIMIT, f"the limit of {flag}")
    try:
        return source, json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{source} is not JSON ({err})") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"{source} is nested too deeply") from None


def _read_json_schema(text: str) -> dict[str, Any]:
    """``--json-schema FILE|JSON``: a JSON schema, an OpenAI ``json_schema`` object
    (``{"name", "schema", "strict"}``) or a whole ``response_format``, given inline or as a
    file; returned as a response_format."""
    import argparse

    source, value = _read_json_argument(text, "--json-schema")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{source} is not a JSON object")
    if value.get("type") == "json_schema" and "json_schema" in value:
        return value
    if "schema" in value and "name" in value and "type" not in value:
        return {"type": "json_schema", "json_schema": value}
    name = re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(source))[0])[:64]
    return {"type": "json_schema", "json_schema": {"name": name if source != "the argument" and name else "schema",
                                                   "schema": value, "strict": True}}


def _read_tools(text: str) -> list[Any]:
    """``--tools FILE|JSON``: a list of tools (OpenAI's), or one tool, inline or in a file."""
    value = _read_json_argument(text, "--tools")[1]
    return value if isinstance(value, list) else [value]


def _read_tool_choice(text: str) -> Any:
    """``--tool-choice none|auto|required|NAME``: a bare NAME is that function, named."""
    return text if text in TOOL_CHOICES else {"type": "function", "function": {"name": text}}


def _read_grammar(path: str) -> str:
    """``--grammar FILE``: the file's text."""
    return _read_limited(path, STRUCTURE_LIMIT, "the limit of --grammar")


def _read_template(path: str) -> str:
    """``--template-file FILE``: the file's text, no longer than a prompt (each prompt holds it)."""
    return _read_limited(path, setting_default("max_prompt_bytes"), "the limit of a prompt (NRVNA_MAX_PROMPT_BYTES)")


def _read_object(flag: str) -> Callable[[str], dict[str, Any]]:
    """A flag's argument read as a JSON object (``--metadata JSON``, ``--chat-template-kwargs JSON``)."""

    def read(text: str) -> dict[str, Any]:
        import argparse
        import json

        try:
            value = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
        except RecursionError:
            # Input, not a usage mistake: one line, as a JSONL line's says (main reports it).
            raise InvalidInput(f"{flag}: JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("not a JSON object")
        return value

    return read


def _read_bias(text: str) -> tuple[str, float]:
    """``--logit-bias ID=BIAS``: one token's bias."""
    import argparse

    token, _, bias = text.partition("=")
    try:
        return str(int(token)), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN_ID=BIAS (e.g. 15043=-100)") from None


def _json_object(key: str, value: Any, limit: int) -> dict[str, Any]:
    """``value`` if it is a JSON object of at most ``limit`` bytes as JSON, else InvalidInput."""
    import json

    if not isinstance(value, dict):
        raise InvalidInput(f"parameter {key} must be a JSON object")
    try:
        size = len(json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8"))
    except RecursionError:
        raise InvalidInput(f"parameter {key}: JSON nested too deeply") from None
    except (TypeError, ValueError, UnicodeEncodeError) as err:
        raise InvalidInput(f"parameter {key} cannot be written as JSON ({err})") from None
    if size > limit:
        raise InvalidInput(f"parameter {key} is {size} bytes as JSON; the limit is {limit}")
    return value


def _check_metadata(value: Any, param: Param) -> dict[str, Any]:
    """A JSON object of at most ``param.high`` bytes as JSON, kept as given."""
    return _json_object("metadata", value, param.high)


def _check_template_kwargs(value: Any, param: Param) -> dict[str, Any]:
    """Variables for the chat template: a JSON object, none named as one the daemon sets."""
    value = _json_object("chat_template_kwargs", value, param.high)
    taken = sorted(TEMPLATE_VARIABLES.intersection(value))
    if taken:
        raise InvalidInput(f"parameter chat_template_kwargs may not set {', '.join(taken)}: the daemon sets "
                           f"{'it' if len(taken) == 1 else 'them'} (give messages, tools... as parameters)")
    return value


def conversation_turns(prompt: str, params: Mapping[str, Any], answer: str,
                       message: Optional[Mapping[str, Any]] = None) -> Optional[list[dict[str, Any]]]:
    """A chat job's whole conversation once it has answered: its turns (its messages, or its
    system message and prompt; a child's, its parent's before them: resolved at its claim)
    and its answer as the assistant's turn (``message``: an answer of tool calls, ``{"content",
    "tool_calls"}``). None for a job with no turns (raw, embed)."""
    if job_param(params, "raw") or job_param(params, "embed"):
        return None
    turns = [dict(turn) for turn in (job_param(params, "messages") or [{"role": "user", "content": prompt}])]
    system = job_param(params, "system")
    if system and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system})
    if message is not None:
        return turns + [{"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]}]
    return turns + [{"role": "assistant", "content": answer}]


def _check_parent(value: Any, param: Param) -> str:
    """A parent: a job ID's form (that the job exists is checked where the workspace is known)."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise InvalidInput(f"parameter parent must be a job ID (got {str(value)[:80]!r})")
    return value


def _check_budget(value: Any, param: Param) -> int:
    """A thinking budget: an integer from 0; -1, llama-server's "no budget", is refused with the
    way to say that here (leave the parameter out)."""
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        raise InvalidInput("parameter thinking_budget_tokens=-1: leave it out for no budget (0 turns thinking off)")
    return Param(int, low=param.low, high=param.high, help=param.help).validate("thinking_budget_tokens", value)


def thinking_budget(params: Mapping[str, Any]) -> Optional[int]:
    """The most tokens a job may think: its thinking_budget_tokens, else its reasoning_effort's
    (EFFORT_BUDGETS), else None (no budget of its own)."""
    budget = params.get("thinking_budget_tokens")
    if budget is None and params.get("reasoning_effort") is not None:
        budget = EFFORT_BUDGETS[params["reasoning_effort"]]
    return budget


def _check_text(key: str, text: str) -> None:
    """A parameter's text must be writable as UTF-8 (a lone surrogate, from a JSON escape
    or from undecodable bytes in an argument, is not) and hold no NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"parameter {key} is not valid Unicode (a lone surrogate or undecodable bytes)") from None
    if "\x00" in text:
        raise InvalidInput(f"parameter {key} contains a NUL byte")


def _check_messages(messages: Any, param: Param) -> list[dict[str, Any]]:
    """Chat turns as ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``; an
    assistant's may carry ``tool_calls`` (its content then may be null), a tool's answer its
    ``tool_call_id``."""
    limit = param.high
    if not isinstance(messages, list) or not 1 <= len(messages) <= limit:
        raise InvalidInput(f"messages must be a list of 1 to {limit} {{role, content}} objects")
    clean: list[dict[str, Any]] = []
    for i, turn in enumerate(messages):
        # An assistant turn replayed from a thinking model's reply carries its reasoning_content:
        # accepted and left out, as thinking templates leave past thinking out of the prompt.
        if not isinstance(turn, dict) or set(turn) - {"role", "content", "name", "reasoning_content", "tool_calls",
                                                      "tool_call_id", "refusal"}:
            raise InvalidInput(f"messages[{i}] must be an object with role and content")
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise InvalidInput(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        extra: dict[str, Any] = {}
        if turn.get("tool_calls") is not None:
            calls = turn["tool_calls"]
            if role != "assistant" or not isinstance(calls, list) or not calls:
                raise InvalidInput(f"messages[{i}].tool_calls: only an assistant turn has them, a list of calls")
            extra["tool_calls"] = [_check_call(call, f"messages[{i}].tool_calls[{k}]") for k, call in enumerate(calls)]
            content = "" if content is None else content
        if role == "tool":
            if not isinstance(turn.get("tool_call_id"), str) or not turn["tool_call_id"]:
                raise InvalidInput(f"messages[{i}]: a tool turn needs the tool_call_id it answers")
            _check_text(f"messages[{i}].tool_call_id", turn["tool_call_id"])
            extra["tool_call_id"] = turn["tool_call_id"]
            if isinstance(turn.get("name"), str):
                extra["name"] = turn["name"]
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise InvalidInput(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidInput(f"messages[{i}].content must be a string without NUL bytes")
        _check_text(f"messages[{i}].content", content)
        clean.append({"role": role, "content": content, **extra})
    if not any(t["content"].strip() or t.get("tool_calls") for t in clean):
        raise InvalidInput("messages are all empty")
    return clean


def _check_response_format(value: Any, param: Param) -> dict[str, Any]:
    """OpenAI's response_format: text, json_object, or json_schema with a schema the
    grammar converter honours whole (see check_json_schema)."""
    import json

    limit = param.high
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidInput('response_format must be {"type": "json_schema", "json_schema": {...}}, '
                           '{"type": "json_object"} or {"type": "text"}')
    kind = value["type"]
    if kind != "json_schema":
        if set(value) != {"type"}:
            raise InvalidInput(f"response_format of type {kind} takes no other field "
                               f"({sorted(set(value) - {'type'})[0]!r})")
        return {"type": kind}
    if set(value) != {"type", "json_schema"} or not isinstance(value["json_schema"], dict):
        raise InvalidInput('response_format json_schema must be {"type": "json_schema", "json_schema": '
                           '{"name", "schema", "strict"}}')
    spec = value["json_schema"]
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise InvalidInput(f"response_format.json_schema: unknown field {sorted(unknown)[0]!r}")
    if "name" in spec and not (isinstance(spec["name"], str) and _SCHEMA_NAME.fullmatch(spec["name"])):
        raise InvalidInput("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'")
    if spec.get("strict") not in (None, True, False):
        raise InvalidInput("response_format.json_schema.strict must be true or false")
    if not isinstance(spec.get("description", ""), str):
        raise InvalidInput("response_format.json_schema.description must be a string")
    if not isinstance(spec.get("schema"), dict):
        raise InvalidInput("response_format.json_schema.schema must be a JSON Schema object")
    try:
        text = json.dumps(spec["schema"], ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise InvalidInput("response_format.json_schema.schema holds a number that is not finite") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidInput("response_format.json_schema.schema is not valid Unicode (a lone surrogate)") from None
    if size > limit:
        raise InvalidInput(f"response_format.json_schema.schema is over {limit} bytes")

    def check() -> None:
        try:
            check_json_schema(spec["schema"])
        except InvalidInput as err:
            raise InvalidInput(f"response_format: {err}") from None

    _checked(("schema", text), check)
    return value


def _check_logit_bias(value: Any, param: Param) -> dict[str, float]:
    """OpenAI's logit_bias: {"token ID": bias}."""
    low, high = param.low, param.high
    if not isinstance(value, dict) or len(value) > 1024:
        raise InvalidInput('logit_bias must be an object {"TOKEN_ID": BIAS} of at most 1024 tokens')
    clean = {}
    for token, bias in value.items():
        if not (isinstance(token, str) and re.fullmatch("[0-9]{1,10}", token)):
            raise InvalidInput(f"logit_bias: {token!r} is not a token ID")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
            raise InvalidInput(f"logit_bias: the bias of token {token} must be a number from {low:g} to {high:g}")
        clean[str(int(token))] = float(bias)
    return clean


def _check_input(value: Any, param: Param) -> list[str]:
    """An embed job's texts (see check_inputs)."""
    return check_inputs(value, param.high)


def job_param(params: Mapping[str, Any], name: str, config: Optional[Config] = None) -> Any:
    """A job's parameter: its own value, else the daemon's setting of that name, else the
    table's default."""
    if name in params:
        return params[name]
    if config is not None and name in SETTINGS:
        return getattr(config, name)
    return PARAMS[name].default


def validate_params(params: Mapping[str, Any], max_tokens: Optional[int] = None) -> dict[str, Any]:
    """Check per-job parameters; return them normalized or raise InvalidInput. ``max_tokens``:
    the daemon's default of that parameter (None: NRVNA_PREDICT as this process sees it)."""
    if not isinstance(params, dict):
        raise InvalidInput("params must be a JSON object")
    clean: dict[str, Any] = {}
    for key, value in params.items():
        if key not in PARAMS:
            raise InvalidInput(f"unknown parameter {key!r} (known: {', '.join(PARAMS)})")
        if value is not None:
            clean[key] = PARAMS[key].validate(key, value)
    if "tag" in clean and not ID_PATTERN.fullmatch(clean["tag"]):
        raise InvalidInput(f"invalid tag {clean['tag']!r} (letters, digits, '.', '_', '-'; not starting with '.')")
    if "endpoint" in clean and clean["endpoint"] not in ENDPOINTS:
        raise InvalidInput(f"endpoint must be one of {', '.join(ENDPOINTS)}")
    if "grammar" in clean:
        _checked(("grammar", clean["grammar"]), lambda: check_grammar(clean["grammar"]))
    check_combination(clean, max_tokens)
    return clean


def tool_choice(params: Mapping[str, Any]) -> Any:
    """A job's tool_choice: none without tools, else its own, else auto (OpenAI's defaults)."""
    if not job_param(params, "tools"):
        return "none"
    return job_param(params, "tool_choice") or "auto"


def parallel_calls(params: Mapping[str, Any]) -> bool:
    """Whether a job's answer may hold several tool calls (OpenAI's default: yes)."""
    return job_param(params, "parallel_tool_calls") is not False


def constraint(params: Mapping[str, Any]) -> Optional[str]:
    """What constrains a job's output: "tools", "json_schema", "json_object", "grammar" or None."""
    if tool_choice(params) != "none":
        return "tools"
    if job_param(params, "grammar") is not None:
        return "grammar"
    kind = (job_param(params, "response_format") or {}).get("type")
    return kind if kind in ("json_schema", "json_object") else None


def check_logprobs_size(params: Mapping[str, Any], max_tokens: Optional[int] = None) -> None:
    """InvalidInput when a job would record more than LOGPROBS_MAX log-probabilities (its
    max_tokens, else ``max_tokens``, else NRVNA_PREDICT as this process sees it)."""
    if not job_param(params, "logprobs"):
        return
    n, top = job_param(params, "n"), job_param(params, "top_logprobs") or 0
    tokens = job_param(params, "max_tokens")
    given = tokens is not None
    if not given:
        tokens = max_tokens if max_tokens is not None else setting_default("max_tokens")
    if n * tokens * (top + 1) > LOGPROBS_MAX:
        whence = "" if given else " (the default, NRVNA_PREDICT)"
        raise InvalidInput(f"logprobs: n x max_tokens x (top_logprobs + 1) = {n} x {tokens}{whence} x {top + 1} = "
                           f"{n * tokens * (top + 1)} log-probabilities, over the limit of {LOGPROBS_MAX} a job "
                           "(give a smaller max_tokens, n or top_logprobs)")


def check_combination(params: Mapping[str, Any], max_tokens: Optional[int] = None) -> None:
    """Raise InvalidInput for parameters that cannot go together (also for a batch line
    merged with the file's defaults); ``max_tokens`` as for validate_params."""
    kind = (job_param(params, "response_format") or {}).get("type")
    if job_param(params, "grammar") is not None and kind in ("json_schema", "json_object"):
        raise InvalidInput("give grammar or response_format, not both")
    _check_tool_use(params)
    if job_param(params, "stop") and constraint(params):
        raise InvalidInput("stop cannot be combined with grammar or response_format: the grammar decides "
                           "where the output ends (a stop string inside a JSON value would cut it short)")
    if job_param(params, "top_logprobs") is not None and not job_param(params, "logprobs"):
        raise InvalidInput("top_logprobs needs logprobs: true")
    if job_param(params, "parent") is not None and job_param(params, "raw"):
        raise InvalidInput("a raw prompt has no turns to continue: give parent without raw")
    check_logprobs_size(params, max_tokens)
    if job_param(params, "endpoint") and (job_param(params, "endpoint") == "/v1/embeddings") != bool(job_param(params, "embed")):
        raise InvalidInput("endpoint /v1/embeddings goes with embed jobs only")
    if job_param(params, "embed"):
        for key, value in params.items():
            if key not in EMBED_PARAMS and value != PARAMS[key].default:
                raise InvalidInput(f"an embed job takes no {key} (it generates nothing)")
    else:
        for key in EMBED_ONLY:
            if job_param(params, key) != PARAMS[key].default:
                raise InvalidInput(f"{key} is for embed jobs (give embed: true, or submit --embed)")


def tool_answers(turns: list[dict[str, Any]], calls: Optional[Iterable[str]], made: Optional[str] = None) -> None:
    """Every ``tool`` turn answers a call of the assistant turn it follows (other tool turns
    between them), as OpenAI's chat requires: InvalidInput naming the first that does not.
    ``calls``: the IDs of the calls that ``made`` (a parent's answer) made, which tool turns first
    in ``turns`` answer; ``()`` for none; None while they are not known (then they are not checked)."""
    called = None if calls is None else set(calls)
    for i, turn in enumerate(turns):
        if turn["role"] == "assistant":
            called, made = {call["id"] for call in turn.get("tool_calls") or []}, f"messages[{i}]"
        elif turn["role"] == "user":
            called, made = set(), None
        elif turn["role"] == "tool" and called is not None and turn["tool_call_id"] not in called:
            said = f"messages[{i}] answers tool call {turn['tool_call_id']!r}"
            if made is None:
                raise InvalidInput(f"{said}, but no assistant turn's calls come right before it (a tool turn "
                                   "answers the calls of the assistant turn it follows)")
            raise InvalidInput(f"{said}, which {made} did not make (its calls: "
                               f"{', '.join(sorted(called)[:8]) or 'none'})")


def _check_tool_use(params: Mapping[str, Any]) -> None:
    """What tools go with: a choice naming one of them; no other constraint, stop string or raw
    prompt unless the choice is none; every tool answer right after the call it answers (see
    tool_answers)."""
    tools, choice = job_param(params, "tools"), job_param(params, "tool_choice")
    if not tools:
        for key in ("tool_choice", "parallel_tool_calls"):
            if job_param(params, key) is not None and key in params:
                raise InvalidInput(f"{key} needs tools")
    else:
        named = tool_choice_name(choice)
        if named is not None and named not in [tool["function"]["name"] for tool in tools]:
            raise InvalidInput(f"tool_choice names {named!r}, which is none of the tools")
        if job_param(params, "raw") or job_param(params, "endpoint") == "/v1/completions":
            raise InvalidInput("tools need the chat template: not with a raw prompt or /v1/completions")
        if tool_choice(params) != "none":
            kind = (job_param(params, "response_format") or {}).get("type")
            if job_param(params, "grammar") is not None or kind in ("json_schema", "json_object"):
                raise InvalidInput("tools cannot be combined with grammar or response_format (unless tool_choice "
                                   "is none): the calls' grammar decides the output")
            if job_param(params, "stop"):
                raise InvalidInput("tools cannot be combined with stop (unless tool_choice is none): a stop string "
                                   "inside a call would cut it short")
    # Tool turns first answer the calls of the parent's answer, known only with the workspace (a
    # batch line's parent may come from --parent): the submit and the claim check them (_check_parents).
    tool_answers(job_param(params, "messages") or [], None)


def check_inputs(texts: Any, limit: int = 2048) -> list[str]:
    """An embed job's texts: 1 to ``limit`` non-empty strings (OpenAI's limit is 2048)."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not 1 <= len(texts) <= limit:
        raise InvalidInput(f"input must be a string or a list of 1 to {limit} strings")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            kind = "token IDs" if isinstance(text, (int, list)) else "not a string"
            raise InvalidInput(f"input[{i}] is {kind}: send text (token arrays are not supported)")
        if not text.strip():
            raise InvalidInput(f"input[{i}] is empty")
        _check_text(f"input[{i}]", text)
    return texts


def render_inputs(texts: list[str]) -> str:
    """An embed job's texts as text a person can read (what prompt.txt holds for a list)."""
    return "\n\n".join(f"[input {i}]\n{text}" for i, text in enumerate(texts)) + "\n"


def render_messages(messages: list[dict[str, Any]]) -> str:
    """Chat turns as text a person can read (what prompt.txt holds for a messages job): an
    assistant's calls a JSON line each after its words, a tool's answer headed by its call's id."""
    import json

    def turn_text(turn: dict[str, Any]) -> str:
        head = f"[tool {turn['tool_call_id']}]" if turn["role"] == "tool" else f"[{turn['role']}]"
        calls = "".join("\n" + json.dumps(call, ensure_ascii=False) for call in turn.get("tool_calls") or [])
        return f"{head}\n{turn['content'] or ''}{calls}"

    return "\n\n".join(turn_text(turn) for turn in messages) + "\n"


def check_prompt(prompt: Any, limit: int) -> bytes:
    """Validate a prompt and return its UTF-8 bytes, or raise InvalidInput."""
    if isinstance(prompt, bytes):
        try:
            prompt = prompt.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidInput(f"prompt is not valid UTF-8 (byte {err.start})") from None
    if not isinstance(prompt, str):
        raise InvalidInput("prompt must be a string")
    try:
        data = prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput("prompt is not valid Unicode (lone surrogate)") from None
    if not prompt.strip():
        raise InvalidInput("prompt is empty")
    if b"\x00" in data:
        raise InvalidInput("prompt contains a NUL byte")
    if len(data) > limit:
        raise InvalidInput(f"prompt is {len(data)} bytes; the limit is {limit} (NRVNA_MAX_PROMPT_BYTES)")
    return data


# Every per-job parameter: validation, `submit`'s flags, the OpenAI line mapping, the
# engine's defaults (`job_param`), `--help` and the README's table come from here. A new
# sampling parameter is one row here and its use in the engine.
PARAMS: dict[str, Param] = {
    "max_tokens": Param(int, low=1, high=1 << 20, flag="--max-tokens", openai=("max_tokens", "max_completion_tokens"),
                         help="most tokens to generate"),
    "temperature": Param(float, low=0.0, high=100.0, flag="--temperature", openai=("temperature",),
                          help="sampling temperature (0 = greedy)"),
    "top_k": Param(int, low=0, high=1 << 20, flag="--top-k", openai=("top_k",),
                    help="sample from the K most likely tokens (0 = off)"),
    "top_p": Param(float, low=0.0, high=1.0, flag="--top-p", openai=("top_p",),
                    help="nucleus sampling: the smallest set with this probability (1 = off)"),
    "min_p": Param(float, low=0.0, high=1.0, flag="--min-p", openai=("min_p",),
                    help="drop tokens less likely than this fraction of the best one (0 = off)"),
    "repeat_penalty": Param(float, low=0.0, high=100.0, flag="--repeat-penalty", openai=("repeat_penalty",),
                             help="divide the logits of the last 64 generated tokens by this (1 = off)"),
    "presence_penalty": Param(float, low=-2.0, high=2.0, default=0.0, flag="--presence-penalty", openai=("presence_penalty",),
                               help="subtract this from the logit of every token among the last 64 generated (0 = off)"),
    "frequency_penalty": Param(float, low=-2.0, high=2.0, default=0.0, flag="--frequency-penalty", openai=("frequency_penalty",),
                                help="subtract this times its count from the logit of each token among the last 64 generated (0 = off)"),
    "logit_bias": Param(dict, low=-100.0, high=100.0, flag="--logit-bias", openai=("logit_bias",), read=("ID=BIAS", _read_bias), gather=dict, check=_check_logit_bias, what="object, biases {low:g} to {high:g}",
                         help="add a bias to tokens' logits before sampling: {\"TOKEN_ID\": BIAS} (the daemon's model's IDs; -100 bans, 100 forces; a flag ID=BIAS per token)"),
    "seed": Param(int, low=0, high=0xFFFFFFFE, flag="--seed", openai=("seed",),
                   help="sampling seed (0 = random; same seed, same text with NRVNA_SEQS=1)"),
    "n": Param(int, low=1, high=CHOICES_MAX, default=1, flag="--n", openai=("n",),
                help="choices: N samples of the prompt in one job, its prompt computed once, choice i seeded seed + i "
                     "(result.txt holds the first, choices.json them all)"),
    "stop": Param(list, low=0, high=16, flag="--stop", openai=("stop",),
                   help="strings that end the generation, not included in the result (a flag per string)"),
    "ignore_eos": Param(bool, default=False, flag="--ignore-eos",
                         help="keep generating past the model's end-of-generation token (not past the end of a grammar)"),
    "response_format": Param(dict, low=0, high=STRUCTURE_LIMIT, flag="--json-schema", openai=("response_format",), read=("FILE|JSON", _read_json_schema), check=_check_response_format, what="object (OpenAI's)",
                              help="constrain the output to JSON: {\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}, {\"type\": \"json_object\"} (any object) or {\"type\": \"text\"} (none); the flag takes a schema, inline or a file"),
    "grammar": Param(str, low=0, high=STRUCTURE_LIMIT, flag="--grammar", openai=("grammar",), read=("FILE", _read_grammar),
                      help="constrain the output to a GBNF grammar (llama.cpp's syntax, starting at rule root); the flag takes a file"),
    "logprobs": Param(bool, default=False, flag="--logprobs", openai=("logprobs",),
                       help=f"record each generated token's log-probability (get --json, export); n x max_tokens x "
                            f"(top_logprobs + 1) may be at most {LOGPROBS_MAX} a job"),
    "top_logprobs": Param(int, low=0, high=20, flag="--top-logprobs", openai=("top_logprobs",),
                           help="with logprobs: also the N most likely tokens at each step"),
    "embed": Param(bool, default=False, flag="--embed", jobs="any",
                    help="embed the input instead of generating: a vector per text (the result holds one JSON array per text, one per line)"),
    "input": Param(list, low=1, high=2048, openai=("input",), check=_check_input, what="list of {low} to {high} strings", jobs="embed",
                    help="with embed: the texts to embed, one vector each, in order (instead of the prompt)"),
    "dimensions": Param(int, low=1, high=1 << 16, flag="--dimensions", openai=("dimensions",), jobs="embed",
                         help="with embed: keep each vector's first N values (normalized again): for models trained for it (Matryoshka)"),
    "encoding_format": Param(("float", "base64"), default="float", openai=("encoding_format",), jobs="embed",
                              help="with embed: how export --format openai writes the vectors (base64: little-endian float32)"),
    "system": Param(str, low=0, high=1 << 20, flag="--system",
                     help="a system message for the chat template"),
    "raw": Param(bool, default=False, flag="--raw",
                  help="send the prompt as is, without the chat template"),
    "timeout": Param(float, low=0.001, high=1e7, flag="--timeout", jobs="any",
                      help="seconds of generation before the job fails with code timeout, keeping its partial text"),
    "messages": Param(list, low=1, high=4096, openai=("messages",), check=_check_messages, what="list of up to {high} {{role, content}}",
                       help="chat turns [{role, content}] instead of a prompt, through the chat template"),
    "tools": Param(list, low=1, high=STRUCTURE_LIMIT, flag="--tools", openai=("tools",), read=("FILE|JSON", _read_tools),
                    check=_check_tools, what=f"list of up to {TOOLS_MAX} functions (OpenAI's)",
                    help="functions the model may call: [{\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}]; the calls come back as tool_calls (see Tool calls); the flag takes the list or one tool, inline or a file"),
    "tool_choice": Param(dict, flag="--tool-choice", openai=("tool_choice",), read=("none|auto|required|NAME", _read_tool_choice),
                          check=_check_tool_choice, what="`none`, `auto`, `required` or a named function",
                          help="with tools: auto (default: text or calls), required (calls only), none (text only), or a named function (a call of it; the flag takes its name)"),
    "parallel_tool_calls": Param(bool, flag="--parallel-tool-calls", openai=("parallel_tool_calls",),
                                  help="with tools: whether one answer may hold several calls (default true, as OpenAI's)"),
    "custom_id": Param(str, low=0, high=512, jobs="any",
                        help="the caller's name for the job (batch files, export; default line-N)"),
    "priority": Param(int, low=-1000, high=1000, default=0, flag="--priority", openai=("priority",), jobs="any",
                       help="higher runs first (FIFO within a priority); a job above every running one pauses lower ones in its context until it ends"),
    "model": Param(str, low=1, high=256, flag="--model", openai=("model",), jobs="any",
                    help="the model to run the job: a GGUF path, a file name or stem, a unique part of one in NRVNA_MODELS_DIR, or an alias (NRVNA_MODEL_ALIASES); a name that matches no model runs on the daemon's model (a note says so; --strict-models refuses it), a known model no running daemon serves waits"),
    "idempotency_key": Param(str, low=1, high=256, flag="--idempotency-key", jobs="any",
                              help="submit this work once: if a job with this key exists (queued, running, done or failed), its ID is returned and nothing is queued (see Submit once)"),
    "metadata": Param(dict, low=0, high=1 << 20, flag="--metadata", openai=("metadata",), read=("JSON", _read_object("--metadata")), check=_check_metadata, what="object, up to {high} bytes as JSON", jobs="any",
                       help="the caller's fields, kept with the job and given back by export --format jsonl: a JSON object (a template's record, by default); never read by the daemon"),
    "chat_template_kwargs": Param(dict, low=0, high=1 << 16, flag="--chat-template-kwargs", openai=("chat_template_kwargs",),
                                   read=("JSON", _read_object("--chat-template-kwargs")), check=_check_template_kwargs,
                                   what="object, up to {high} bytes as JSON",
                                   help="variables for the model's chat template, as llama-server and vLLM pass them (e.g. {\"enable_thinking\": false}); the template's own (messages, tools, bos_token...) are refused"),
    "thinking_budget_tokens": Param(int, low=0, high=1 << 20, flag="--thinking-budget",
                                     openai=("thinking_token_budget", "thinking_budget_tokens", "reasoning_budget_tokens"),
                                     check=_check_budget, what="integer, {low} to {high}",
                                     help="a thinking model's most tokens of thinking: at the budget the daemon closes the block and the answer follows (0 = no thinking; a model that does not think ignores it)"),
    "reasoning_effort": Param(tuple(EFFORT_BUDGETS), flag="--reasoning-effort", openai=("reasoning_effort",),
                               help="a thinking budget by name: none 0, minimal 256, low 1024, medium 2048, high 8192 tokens (thinking_budget_tokens wins); also given to chat templates that read it (gpt-oss)"),
    "parent": Param(str, low=1, high=128, flag="--parent", check=_check_parent, what="a job ID",
                     help="continue that job's conversation: its turns, its answer as the assistant's, then this prompt (or these messages) as the next turn; waits while it runs, fails with parent_failed if it failed"),
    "tag": Param(str, low=0, high=128, flag="--tag", jsonl=False, jobs="any",
                  help="label the jobs (status/wait/export/cancel/retry --tag)"),
    "endpoint": Param(str, low=0, high=32, jsonl=False, jobs="any",
                       help="the OpenAI Batch url a job came from: export answers in its shape"),
}


# OpenAI Batch body field -> the job parameter it carries, in table order.
OPENAI_FIELDS = {field: name for name, param in PARAMS.items() for field in param.openai}
EMBED_ONLY = tuple(name for name, param in PARAMS.items() if param.jobs == "embed")


# The parameters an embed job may carry (every other one is about generating); those only it may.
EMBED_PARAMS = frozenset(name for name, param in PARAMS.items() if param.jobs != "generate")


# The OpenAI Batch endpoints: what a request line may carry and how export answers it.
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint("messages", False, "chat.completion", "chatcmpl-"),
    "/v1/completions": Endpoint("prompt", True, "text_completion", "cmpl-"),
    "/v1/embeddings": Endpoint("input", False, "list", ""),
}


##############################################################################
# 7. Workspace and job directories: layout, IDs, states, meta.json, durable moves, the tag index, the lock
##############################################################################
# Owns the layout on disk and every primitive that reads or moves a job. Invariant: a job's state
# is where its directory is, changed only by move_job (a rename on one filesystem); keys, tags and
# locks are files beside the jobs. Clients and every daemon thread call in; the locks are flocks.


# ============================================================================
# 7.1 Layout, locks and the daemons' records
# ============================================================================
# The workspace's directories and file names (job_path), the workspace lock, a job's lock (hold_job) and
# the daemons' records in daemons/. Invariant: a held flock is the only proof that a daemon or a
# holder is alive; a pid only names it.


# The state directories: a job's place is its state.
WRITING = os.path.join("input", "writing")
READY = os.path.join("input", "ready")
PROCESSING = "processing"
OUTPUT = "output"
FAILED = "failed"
LAYOUT = (WRITING, READY, PROCESSING, OUTPUT, FAILED)
PROMPT_FILE = "prompt.txt"
PARAMS_FILE = "params.json"
RESULT_FILE = "result.txt"
ERROR_FILE = "error.txt"
META_FILE = "meta.json"
PARTIAL_FILE = "partial.txt"  # text generated so far (running), or before a failure
LOGPROBS_FILE = "logprobs.json"  # each generated token's log-probability, for jobs that ask
CHOICES_FILE = "choices.json"  # a job of n > 1 choices: every choice (Outcome.choices)
REASONING_FILE = "reasoning.txt"  # a thinking model's thinking, apart from result.txt (Outcome.reasoning)
CONVERSATION_FILE = "conversation.json"  # a done chat job's turns and its answer: what a child continues
TOOL_CALLS_FILE = "tool_calls.json"  # an answer of tool calls: {"content", "tool_calls"} (Outcome.message)
CANCEL_FILE = "cancel"  # written into a job's dir by `nrvna cancel`: the daemon stops the job
# A running job's meta.json as its claim found it, hard-linked by the claim: a hand-back puts it
# back with a rename, which needs no free space. A temporary (.tmp) to recovery, which removes it.
CLAIMED_META = ".meta.json.claimed.tmp"
DAEMON_FILE = "daemon.json"
TAGS = "tags"  # tags/<tag>/<time_ns>_<first id>.ids: which jobs a submit labelled (the tag index)
KEYS = "keys"  # keys/<sha256 of an idempotency key>: the ID of the job submitted with it
HOOKS_OWED = os.path.join("hooks", "done")  # hooks/done/<id>: a job ended and its hooks have not run yet
HOOKS_BATCH = os.path.join("hooks", "batch")  # hooks/batch/<tag>: {"jobs": N, "done", "failed", "ran": bool} of its last batch hook
# A job's hook bookkeeping that raised is tried again after 2 x, 4 x, 8 x... this (1 s, 2 s, 4 s...),
# at most every HOOK_RETRY_MAX seconds.
HOOK_RETRY_SECONDS = 0.5
HOOK_RETRY_MAX = 600.0
DAEMONS = "daemons"  # daemons/<pid>-<ns>.lock (flock'ed by its daemon while it lives) and .json (its figures)
# A non-directory found in ready/ is wrapped in a real job dir under this name in failed/.
QUARANTINED_ENTRY = "entry"
GENERATED_ID = re.compile(r"(\d+)_(\d+)_(\d+)")
DIR_MODE = 0o700


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 53


def _is_time(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < 1e12  # NaN fails both comparisons


def _is_text(value: Any) -> bool:
    return type(value) is str and len(value) <= 1 << 16


def shallow(value: Any, most: int = 32) -> bool:
    """Whether ``value`` nests no deeper than ``most`` lists and dicts: nrvna writes none deeper,
    and copying, comparing or printing a far deeper one (900 levels parse) exhausts the stack."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= most:
                return False
            stack.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return True


def parse_meta(text: Optional[str]) -> dict[str, Any]:
    """meta.json's text as a dict ({} when absent or unreadable)."""
    import json

    if not text:
        return {}
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return {}
    return meta if isinstance(meta, dict) else {}


def read_record(path: str, limit: int = 1 << 20) -> dict[str, Any]:
    """A small JSON record another process wrote (a daemon's record, a batch hook's), as
    parse_meta reads it: {} when it is absent, not a regular file (a FIFO is never waited on, a
    link never followed), over ``limit`` bytes or not a JSON object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
    except OSError:
        return {}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return {}
        return parse_meta(os.read(fd, limit + 1)[:limit].decode("utf-8", "replace"))
    except OSError:
        return {}
    finally:
        os.close(fd)


def job_path(workspace: str, sub: str, job_id: str = "") -> str:
    """``workspace/sub/job_id`` (or the state directory itself)."""
    return os.path.join(workspace, sub, job_id) if job_id else os.path.join(workspace, sub)


def ensure_workspace(workspace: str) -> None:
    """Create the workspace layout if needed (mode 0700); fail clearly if it cannot be used.

    The workspace itself is created only when its parent exists: a typo in a path should be
    an error, not a tree of new directories somewhere unexpected.
    """
    if os.path.isdir(os.path.join(workspace, READY)) and os.path.isdir(os.path.join(workspace, FAILED)):
        return
    if os.path.lexists(workspace) and not os.path.isdir(workspace):
        raise WorkspaceError(f"workspace {workspace} is not a directory")
    parent = os.path.dirname(os.path.abspath(workspace))
    if not os.path.isdir(parent):
        raise WorkspaceError(f"workspace {workspace}: parent directory {parent} does not exist")
    try:
        try:
            os.mkdir(workspace, DIR_MODE)
            os.chmod(workspace, DIR_MODE)  # mkdir's mode is masked by umask
            fsync_dir(parent)
        except FileExistsError:
            pass
        for sub in ("input",) + LAYOUT:
            path = os.path.join(workspace, sub)
            try:
                os.mkdir(path, DIR_MODE)
                os.chmod(path, DIR_MODE)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise WorkspaceError(f"workspace {workspace}: {sub} exists and is not a directory") from None
        fsync_dir(os.path.join(workspace, "input"))
        fsync_dir(workspace)
    except PermissionError:
        raise WorkspaceError(f"workspace {workspace} is not writable") from None
    except OSError as err:
        raise WorkspaceError(f"workspace {workspace}: {_os_error(err)}") from None


def _flock(fd: int, exclusive: bool = True, wait: bool = False) -> bool:
    """Take a flock on ``fd``; False when another open file holds a conflicting one and
    ``wait`` is False. OSError where the filesystem cannot lock (NFS, say)."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


class WorkspaceLock:
    """A flock on processing/ (what it guards), held for moments, never for a daemon's life: by
    a recovery pass (a daemon's start; a live daemon requeuing a dead one's jobs, or any job
    nobody holds), by a daemon's registration, by a quarantine and by a client failing an
    orphan, so that no two of them touch a job nobody holds at the same time. A running job
    is held by its own lock (``hold_job``), which the kernel drops when its daemon dies: that
    is the proof of life. (Not the workspace directory's: earlier versions' daemons held that
    one for life, and a daemon tests it to refuse to start beside one: see _Registry.register.)"""

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self.fd = -1

    def __enter__(self) -> "WorkspaceLock":
        try:
            self.fd = open_dir(os.path.join(self.workspace, PROCESSING))
            _flock(self.fd, wait=True)
        except OSError as err:
            if self.fd >= 0:
                os.close(self.fd)
            raise WorkspaceError(f"workspace {self.workspace} cannot be locked: {_os_error(err)}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


def hold_job(path: str) -> Optional[int]:
    """Open job directory ``path`` and take its lock, not waiting: the descriptor (closing it
    lets go), or None when someone holds it (a live daemon runs it, or is moving it). OSError
    when it cannot be opened. A daemon holds every job it has claimed, from before the
    claim's rename until after the job's last move."""
    return _locked(open_dir(path))


def _locked(fd: int, exclusive: bool = True) -> Optional[int]:
    """``fd`` once a flock on it is taken (not waiting); else None, ``fd`` closed."""
    try:
        if _flock(fd, exclusive):
            return fd
    except OSError:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _same_entry(fd: int, path: str) -> bool:
    """Whether ``path`` still names the directory open as ``fd`` (it was not moved meanwhile)."""
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def hold_orphan(workspace: str, job_id: str) -> Optional[int]:
    """processing/<id> held (see hold_job) when no live daemon holds it: its daemon died.
    None when it is held, gone, or not a directory that can be opened. The caller holds the
    WorkspaceLock, so no other recovery takes it meanwhile."""
    path = job_path(workspace, PROCESSING, job_id)
    try:
        fd = hold_job(path)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES):
            return None
        raise
    if fd is not None and not _same_entry(fd, path):  # ended or requeued before we took it
        os.close(fd)
        return None
    return fd


def register_daemon(workspace: str) -> tuple[int, str]:
    """Make this process a daemon of ``workspace``: a lock file of its own in daemons/, held
    while it lives (flock). Return the lock's descriptor and the daemon's name, ``<pid>-<ns>``
    (unique, where a bare pid could be reused after a SIGKILL). The file is locked under a
    hidden name before it is renamed into place, so a client never sees it unlocked."""
    folder = os.path.join(workspace, DAEMONS)
    try:
        os.mkdir(folder, DIR_MODE)  # not fsynced: liveness, not state (no daemon outlives a power loss)
    except FileExistsError:
        pass
    name = f"{os.getpid()}-{time.time_ns()}"
    folder_fd = open_dir(folder)
    try:
        fd = os.open(f".{name}.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE,
                     dir_fd=folder_fd)
        try:
            _flock(fd)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(f".{name}.lock", f"{name}.lock", src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(f".{name}.lock", folder_fd)
            raise
    finally:
        os.close(folder_fd)
    return fd, name


def _daemon_locks(workspace: str) -> list[str]:
    """The names of daemons/' lock files, oldest daemon first (its name starts with its pid)."""
    try:
        names = os.listdir(os.path.join(workspace, DAEMONS))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((n[:-5] for n in names if n.endswith(".lock") and not n.startswith(".")),
                  key=lambda n: n.split("-")[-1])


def _dead_daemon_lock(workspace: str, name: str, exclusive: bool = False) -> Optional[int]:
    """Daemon ``name``'s lock, taken without waiting: a descriptor holding it when its daemon
    has died (exclusive: to remove its files), None while it lives; -1 when its file is gone."""
    try:
        fd = os.open(os.path.join(workspace, DAEMONS, f"{name}.lock"), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
    except FileNotFoundError:
        return -1
    return _locked(fd, exclusive)


def daemon_alive(workspace: str, name: str) -> bool:
    """Whether daemon ``name`` lives: it holds its lock (the kernel drops it when its holder
    dies), whatever any file says."""
    held = _dead_daemon_lock(workspace, name)
    if held is None:
        return True
    if held >= 0:
        os.close(held)  # held here, it would keep the daemons from reaping it
    return False


def _is_texts(value: Any) -> bool:
    return type(value) is list and all(_is_text(item) for item in value)


# What each field of a daemon's record (daemons/<name>.json) that other processes read must be:
# one of another daemon's (a clash at start, routing, waits) or a client's (model names, `status
# --daemon`). A daemon writes its own; a field planted over it with another type is read as
# absent, and so is a model entry's.
DAEMON_RECORD_FIELDS: dict[str, Callable[[Any], bool]] = {
    "pid": _is_count, "gpu": lambda value: type(value) is int, "models_dir": _is_text, "kinds": _is_texts,
    "models": lambda value: type(value) is list,
    "aliases": lambda value: type(value) is dict and all(map(_is_text, value.values())),
    "hooks": lambda value: type(value) is dict and all(v is None or _is_text(v) for v in value.values()),
}
DAEMON_MODEL_FIELDS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("name", "kind", "load_error"), _is_text),
    "path": lambda value: value is None or _is_text(value),  # None: a runner given in-process
    **dict.fromkeys(("load_failures", "max_load_failures"), _is_count),
    "retry_at": _is_time, "active": lambda value: type(value) is bool,
}


def _checked_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with each field of DAEMON_RECORD_FIELDS (and each model's) present only if it is
    as a daemon writes it."""
    record = {k: v for k, v in record.items()
              if shallow(v) and (k not in DAEMON_RECORD_FIELDS or DAEMON_RECORD_FIELDS[k](v))}
    if "models" in record:
        record["models"] = [{k: v for k, v in m.items() if k not in DAEMON_MODEL_FIELDS or DAEMON_MODEL_FIELDS[k](v)}
                            for m in record["models"] if type(m) is dict]
    return record


def daemon_records(workspace: str) -> list[dict[str, Any]]:
    """Every live daemon's record (its daemons/<name>.json: pid, models, GPU, figures), oldest
    first; ``{"pid", "name", "starting": True}`` for one that has not written it yet. A
    daemon is live while it holds its lock (the kernel drops it when its holder dies), never
    because a file says so."""
    records = []
    for name in _daemon_locks(workspace):
        if not daemon_alive(workspace, name):
            continue
        record = read_record(os.path.join(workspace, DAEMONS, f"{name}.json"))
        pid = name.split("-")[0]
        record = _checked_record(record)
        records.append(dict(record, name=name) if record else
                       {"pid": int(pid) if pid.isdigit() else -1, "name": name, "starting": True})
    return records


# ============================================================================
# 7.2 IDs, states and meta.json
# ============================================================================
# Job IDs (ordered by time), Status and each state's directory, reading meta.json. Invariant:
# the directory's place is the job's state; meta.json says more, never otherwise. Stateless.


_id_counter = itertools.count()

# What each field of meta.json that nrvna reads back must be. A hand-made, damaged or older
# meta.json may hold anything: a field whose value is not so is read as absent (job_meta), so
# no reader (recovery at start, export, events, hooks, retry) meets a type it does not expect.
META_FIELDS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("attempts", "write_failures", "retries", "prompt_tokens", "generated_tokens",
                     "reasoning_tokens", "prompt_computed"), _is_count),
    **dict.fromkeys(("submitted", "started", "finished"), _is_time),
    **dict.fromkeys(("id", "code", "finish_reason", "model", "worker", "daemon", "thinking_closed",
                     "last_write_error"),
                    _is_text),
    "events": lambda value: type(value) is list,  # each entry checked by job_history
    "errors": lambda value: type(value) is list and all(type(entry) is dict for entry in value),
    "prompt_reused": lambda value: type(value) is dict and all(_is_count(n) for n in value.values()),
}


def generate_id() -> str:
    """A new job ID, ``<unix_ts>_<pid>_<counter>`` (uniqueness is enforced by mkdir)."""
    return f"{int(time.time())}_{os.getpid()}_{next(_id_counter)}"


def is_valid_id(job_id: Any) -> bool:
    """True when ``job_id`` can name a job: no path ever leaves the workspace."""
    return isinstance(job_id, str) and ID_PATTERN.fullmatch(job_id) is not None


def order_key(job_id: str) -> tuple[int, int, int, str]:
    """Submission order: the ID's time, then its counter (hand-made IDs sort first)."""
    match = GENERATED_ID.fullmatch(job_id)
    if match is None:
        return (0, 0, 0, job_id)
    stamp, pid, counter = match.groups()
    return (int(stamp), int(counter), int(pid), job_id)


class Status(str, enum.Enum):
    """Where a job is: its directory is its state."""

    Queued = "queued"
    Running = "running"
    Done = "done"
    Failed = "failed"
    Missing = "missing"

    def __str__(self) -> str:
        return self.value

    @property
    def finished(self) -> bool:
        """Done or Failed: the job will not change again on its own."""
        return self in (Status.Done, Status.Failed)


def locate_job(workspace: str, job_id: str) -> tuple[Status, str]:
    """Where a job is now: its state and directory (``Missing`` and "" if nowhere)."""
    if not is_valid_id(job_id):
        return Status.Missing, ""
    # Forward moves cannot hide a job from a lifecycle-order check; a backward one
    # (requeue, retry) can, once per pass, so look again before saying Missing.
    for _ in range(5):
        for sub, status in STATE_DIRS:
            path = os.path.join(workspace, sub, job_id)
            if os.path.lexists(path):
                return status, path
    return Status.Missing, ""


def parent_unfinished(workspace: str, job_id: Optional[str]) -> bool:
    """Whether ``job_id`` names a job that is queued or running (a parent its child waits for)."""
    return job_id is not None and locate_job(workspace, job_id)[0] in (Status.Queued, Status.Running)


def job_meta(text: Optional[str]) -> dict[str, Any]:
    """meta.json's text as a dict, each field of META_FIELDS present only if it is as nrvna
    writes it, no field nested deeper than ``shallow`` allows; other fields as they are."""
    meta = parse_meta(text)
    for name in list(meta):
        if not shallow(meta[name]) or (name in META_FIELDS and not META_FIELDS[name](meta[name])):
            del meta[name]
    return meta


def read_meta(dir_fd: int) -> dict[str, Any]:
    """The meta.json of the job directory open as ``dir_fd`` ({} when it has none), as job_meta reads it."""
    try:
        return job_meta(read_file(dir_fd, META_FILE, 1 << 20).decode("utf-8", "replace"))
    except (FileNotFoundError, JobError):
        return {}


def params_limit(max_prompt_bytes: Optional[int] = None) -> int:
    """The largest params.json a submit can make: its texts (messages, input, system) are
    bounded by the prompt's limit and their own, and JSON writes a character in at most 6
    bytes (\\u0001). Read no more than this: a planted file may be any size. Without an
    argument, NRVNA_MAX_PROMPT_BYTES (its default when unset or invalid)."""
    if max_prompt_bytes is None:
        try:
            max_prompt_bytes = setting_default("max_prompt_bytes")
        except NrvnaError:
            max_prompt_bytes = SETTINGS["max_prompt_bytes"].default
    return 8 * max_prompt_bytes + (8 << 20)


def read_meta_and_params(dir_fd: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The meta.json and params.json of the job directory open as ``dir_fd`` ({} for either
    when absent, unreadable or over its limit)."""
    try:
        raw: Optional[bytes] = read_file(dir_fd, PARAMS_FILE, params_limit())
    except (FileNotFoundError, JobError):
        raw = None
    return read_meta(dir_fd), parse_meta(raw.decode("utf-8", "replace")) if raw else {}


def dump_meta(meta: Mapping[str, Any]) -> bytes:
    """meta.json's bytes: sorted keys, one per line, UTF-8."""
    import json

    return (json.dumps(meta, ensure_ascii=False, indent=1, sort_keys=True) + "\n").encode("utf-8")


def submitted_time(job_id: str, dir_fd: int) -> Optional[float]:
    """When the job was submitted: its prompt.txt's mtime, else the time in its ID."""
    try:
        return round(os.stat(PROMPT_FILE, dir_fd=dir_fd, follow_symlinks=False).st_mtime, 3)
    except OSError:
        match = GENERATED_ID.fullmatch(job_id)
        return float(match.group(1)) if match else None


# Lifecycle order: a job only moves forward through these (except a requeue), so a reader
# checking them in this order cannot miss a job that moves forward while it looks.
STATE_DIRS = ((READY, Status.Queued), (PROCESSING, Status.Running),
              (OUTPUT, Status.Done), (FAILED, Status.Failed))
STATUS_DIR = {status: sub for sub, status in STATE_DIRS}


# The CLI's exit code for a job in each state.
STATUS_EXIT = {Status.Done: EXIT_OK, Status.Failed: EXIT_FAILED, Status.Missing: EXIT_MISSING,
               Status.Queued: EXIT_UNFINISHED, Status.Running: EXIT_UNFINISHED}


# ============================================================================
# 7.3 A job's history
# ============================================================================
# job_history, record_event, owe_hooks, move_job and mark_failed. Invariant: job_history reconciles
# meta.json's events with where the job is, so no change is reported that did not happen and none
# that did is lost.


# Each change of state appends [time, to] or [time, to, code] to meta.json's "events", in the
# same meta.json write the change makes anyway: no other file, no extra fsync. Some writes
# come before their rename (done, failed, cancelled, requeued: the job's files first, then
# the move) and one after (running: the claim's rename, then meta.json), so a crash can leave
# one entry that did not happen, or miss one that did. The job's directory is the truth, and
# job_history() reconciles the entries with it: a last entry whose move did not happen (the
# job is still where it was before it) is dropped; a move that has no entry gets one, timed
# by the directory's ctime. So no change is reported that did not happen, and none that did
# is lost (`nrvna events`, and the on-done hook's at-least-once, rest on this).

EVENT_STATUS = {"queued": Status.Queued, "requeued": Status.Queued, "running": Status.Running,
                "done": Status.Done, "failed": Status.Failed, "cancelled": Status.Failed}
_WRITTEN_BEFORE_MOVE = frozenset({"done", "failed", "cancelled", "requeued"})
SUB_STATUS = {sub: status for sub, status in STATE_DIRS}


def mark_failed(workspace: str, sub: str, job_id: str, code: str, message: str,
                came_from: Optional[Status] = None) -> None:
    """Write error.txt and meta.json (with ``code``) into the job dir ``sub/job_id``, durably
    (the caller then moves it to failed/ if it is not there; ``came_from``: the state it left,
    when it is there already)."""
    fd = open_dir(job_path(workspace, sub, job_id))
    try:
        meta = read_meta(fd)
        if "submitted" not in meta:
            meta["submitted"] = submitted_time(job_id, fd)
        meta.update(id=job_id, code=code, finished=round(time.time(), 3))
        record_event(meta, came_from or SUB_STATUS[sub], "cancelled" if code == "cancelled" else "failed", code)
        meta.pop("finish_reason", None)
        write_file(fd, ERROR_FILE, message.encode("utf-8") + b"\n")
        write_file(fd, META_FILE, dump_meta(meta))
        os.fsync(fd)
    finally:
        os.close(fd)


def job_history(meta: Mapping[str, Any], state: Status, submitted: Optional[float],
                moved_at: Optional[float] = None) -> list[list[Any]]:
    """The job's changes of state as ``[time, to, code?]``, starting with ``queued`` at
    ``submitted``, reconciled with where the job is now (``state``; see above)."""
    history: list[list[Any]] = [[submitted or 0.0, "queued"]]
    for entry in meta.get("events") or ():
        if (type(entry) is list and len(entry) in (2, 3) and _is_time(entry[0]) and _is_text(entry[1])
                and entry[1] in EVENT_STATUS and (len(entry) == 2 or _is_text(entry[2]))):
            history.append(list(entry))
    last = history[-1][1]
    if (len(history) > 1 and EVENT_STATUS[last] is not state and last in _WRITTEN_BEFORE_MOVE
            and EVENT_STATUS[history[-2][1]] is state):
        history.pop()  # written, then the daemon or client died before the move
    if EVENT_STATUS[history[-1][1]] is not state and state is not Status.Missing:
        code = meta.get("code") if state is Status.Failed else None
        to = {Status.Queued: "requeued", Status.Running: "running", Status.Done: "done",
              Status.Failed: "cancelled" if code == "cancelled" else "failed"}[state]
        history.append([round(moved_at or time.time(), 3), to] + ([code] if code else []))
    return history


def record_event(meta: dict[str, Any], state: Status, to: str, code: Optional[str] = None) -> None:
    """Append the change ``to`` to meta's history, reconciled first with ``state``, where the
    job is before this change (the caller writes meta.json)."""
    history = job_history(meta, state, 0.0)[1:]
    history.append([round(time.time(), 3), to] + ([code] if code else []))
    meta["events"] = history


def owe_hooks(workspace: str, job_id: str) -> None:
    """Record durably, before a job's move to output/ or failed/, that its hooks are owed
    (only where a daemon with hooks made hooks/done/): they run at least once, even if the
    daemon dies between the move and the hook."""
    folder = os.path.join(workspace, HOOKS_OWED)
    try:
        fd = os.open(os.path.join(folder, job_id), os.O_WRONLY | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    except FileNotFoundError:
        return
    os.close(fd)
    fsync_dir(folder)


def move_job(workspace: str, job_id: str, src: str, dst: str) -> None:
    """Move a job between state directories durably: the rename (never replacing anything),
    then an fsync of the destination and of the source directory."""
    move(job_path(workspace, src, job_id), job_path(workspace, dst, job_id))
    fsync_dir(job_path(workspace, dst))
    fsync_dir(job_path(workspace, src))


def check_ids(ids: Iterable[str]) -> None:
    """Raise InvalidInput naming the first ID that cannot name a job."""
    for job_id in ids:
        if not is_valid_id(job_id):
            shown = job_id if len(job_id) <= 40 else job_id[:40] + "..."
            raise InvalidInput(f"invalid job ID {shown!r} (expected letters, digits, '.', '_', '-'; "
                               "at most 128, not starting with '.')")


def require_workspace(workspace: str) -> None:
    """Raise InvalidInput unless ``workspace`` is an existing nrvna workspace: client
    commands never create one by reading it, and a typo (``status /etc``) is an error, not an
    empty answer."""
    if not os.path.isdir(workspace):
        raise InvalidInput(f"workspace {workspace} does not exist")
    if not os.path.isdir(os.path.join(workspace, READY)):
        raise InvalidInput(f"{workspace} is not an nrvna workspace (it has no input/ready/; "
                           "a submit or a daemon creates one)")


def require_tag(workspace: str, tag: str) -> None:
    """Raise InvalidInput for a malformed tag, NoSuchJob for one no job was submitted with
    (or whose jobs are all cleaned): ``wait --tag typo`` must not succeed on nothing."""
    if not isinstance(tag, str) or not ID_PATTERN.fullmatch(tag):
        raise InvalidInput(f"invalid tag {tag!r} (letters, digits, '.', '_', '-'; not starting with '.')")
    if not _tag_known(workspace, tag):
        raise NoSuchJob(f"no tag {tag} in {workspace}")


def _tag_known(workspace: str, tag: str) -> bool:
    """Whether ``tag`` has an index file (one with no rows: an empty shard's tag)."""
    try:
        return any(n.endswith(".ids") and not n.startswith(".") for n in os.listdir(os.path.join(workspace, TAGS, tag)))
    except (FileNotFoundError, NotADirectoryError):
        return False


def _read_or_none(dir_fd: int, name: str) -> Optional[bytes]:
    try:
        return read_file(dir_fd, name, 1 << 40)
    except (FileNotFoundError, JobError):
        return None


def _clear_outputs(dir_fd: int, keep: tuple[str, ...] = ()) -> None:
    """Remove what an interrupted attempt may have left (results, temporary files)."""
    for name in os.listdir(dir_fd):
        if name in keep:
            continue
        if name in (RESULT_FILE, ERROR_FILE, PARTIAL_FILE, LOGPROBS_FILE, CHOICES_FILE, REASONING_FILE, CONVERSATION_FILE,
                    TOOL_CALLS_FILE) or (
                name.startswith(".") and name.endswith(".tmp")):
            _unlink_quietly(name, dir_fd)


def _folder_entries(workspace: str, sub: str) -> set[str]:
    """The entries of a workspace folder (a state directory, hooks/done/), not its temporaries."""
    try:
        return {name for name in os.listdir(job_path(workspace, sub)) if not name.startswith(".")}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _all_jobs(workspace: str) -> list[str]:
    """Every job in the workspace, in submission order."""
    return sorted(set().union(*(_folder_entries(workspace, sub) for sub, _ in STATE_DIRS)), key=order_key)


def _tag_folder(workspace: str, tag: str) -> str:
    """tags/<tag>/, made (private, as the workspace) if it is not there yet."""
    folder = os.path.join(workspace, TAGS, tag)
    for path in (os.path.dirname(folder), folder):
        try:
            os.mkdir(path, DIR_MODE)
            os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask: keep the workspace private
        except FileExistsError:
            pass
    return folder


def _write_manifest(workspace: str, tag: str, rows: list[tuple[str, Optional[str]]]) -> None:
    """Record durably that ``rows`` (id, custom_id) carry ``tag``, before they are published."""
    import json

    folder = _tag_folder(workspace, tag)
    fd = open_dir(folder)
    try:
        data = "".join(json.dumps([job_id, cid], ensure_ascii=False) + "\n" for job_id, cid in rows)
        # Named by creation time: IDs order jobs within a process, not across processes. An
        # empty index records a tag with no jobs (a shard that holds none of its file's lines).
        write_file(fd, f"{time.time_ns():020d}_{rows[0][0] if rows else 'empty'}.ids", data.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(folder))


# ============================================================================
# 7.4 Routes and model files
# ============================================================================
# A queued job's route (priority, model, kind) read cheaply from its params.json, and how a model
# name finds its GGUF file. Stateless: the Scanner, the daemon's start and clients call it.


Route = namedtuple("Route", "priority model embed parent", defaults=(None,))


def read_route(job_dir: str) -> Route:
    """A queued job's priority, the model it names and whether it is an embed job, from its
    params.json ((0, None, False) when it says none, or cannot be read: its claim will say
    why). Cheap for the default lane and model: the JSON is parsed only when the file
    mentions a priority, a model or embed."""
    import json

    # The Scanner calls this under the Pool's lock: like the claim, it follows no symlink
    # and opens no FIFO (a planted params.json FIFO would block every worker).
    try:
        dir_fd = open_dir(job_dir)
    except OSError:
        return Route(0, None, False)
    try:
        data = read_file(dir_fd, PARAMS_FILE, params_limit())
    except (OSError, JobError):
        return Route(0, None, False)
    finally:
        os.close(dir_fd)
    if not any(key in data for key in (b'"priority"', b'"model"', b'"embed"', b'"parent"')):
        return Route(0, None, False)
    try:
        params = json.loads(data)
    except (ValueError, RecursionError):
        return Route(0, None, False)
    if not isinstance(params, dict):  # a hand-made params.json: its claim fails it
        return Route(0, None, False)
    priority, model = job_param(params, "priority"), job_param(params, "model")
    lane = PARAMS["priority"]
    if not (isinstance(priority, int) and not isinstance(priority, bool) and lane.low <= priority <= lane.high):
        priority = 0
    parent = job_param(params, "parent")
    return Route(priority, model if isinstance(model, str) and model else None, job_param(params, "embed") is True,
                 parent if isinstance(parent, str) and is_valid_id(parent) else None)


def read_priority(job_dir: str) -> int:
    """A queued job's priority (see read_route)."""
    return read_route(job_dir)[0]


def gguf_files(models_dir: str) -> Optional[list[str]]:
    """The ``*.gguf`` file names in ``models_dir``, sorted (None when it cannot be read)."""
    try:
        return sorted(f for f in os.listdir(models_dir) if f.lower().endswith(".gguf"))
    except OSError:
        return None


def _check_gguf_magic(path: str) -> None:
    """ModelError unless ``path`` is a readable regular file that starts with GGUF (what a
    submit checks of a model it names; the daemon reads the header too: check_gguf)."""
    if not os.path.exists(path):
        raise ModelError(f"model {path} does not exist")
    if os.path.isdir(path):
        raise ModelError(f"model {path} is a directory, not a GGUF file")
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the daemon in open()
        raise ModelError(f"model {path} is not a regular file")
    try:  # O_NONBLOCK: a FIFO put in its place since the stat must not block (submit checks too)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ModelError(f"model {path} is not a regular file")
            magic = os.read(fd, 4)
        finally:
            os.close(fd)
    except OSError as err:
        raise ModelError(f"model {path} cannot be read: {_os_error(err)}") from None
    if magic != b"GGUF":
        raise ModelError(f"model {path} is not a GGUF file (it does not start with 'GGUF')")


def model_file(name: str, models_dir: str, aliases: Mapping[str, str]) -> Optional[str]:
    """The real path of the one model file ``name`` means (see model_matches); None when it
    matches no model, or several: such a job runs as if it named none (submit noted that, or
    refused it)."""
    matches = model_matches(name, models_dir, aliases)
    return os.path.realpath(matches[0]) if len(matches) == 1 else None


def model_elsewhere(name: str, models_dir: str, aliases: Mapping[str, str], served: Iterable[str]) -> Optional[str]:
    """The model file a job naming ``name`` waits for, when that is none of ``served`` (the
    real paths of the models a daemon serves); None when it is one of them, or names no one
    model (see model_file)."""
    path = model_file(name, models_dir, aliases)
    return path if path is not None and path not in set(served) else None


def model_matches(name: str, models_dir: str, aliases: Optional[Mapping[str, str]] = None) -> list[str]:
    """The model files ``name`` may mean: through ``aliases`` first, then a path (one that
    exists, or any name with a '/'), else the ``*.gguf`` files of ``models_dir`` named
    ``name`` (with or without .gguf) or, failing that, holding it (case aside). None, one
    (resolved) or several (ambiguous)."""
    name = (aliases or {}).get(name, name)
    if os.path.exists(name) or os.sep in name:
        return [name] if os.path.exists(name) else []
    candidates = gguf_files(models_dir) or []
    exact = [f for f in candidates if f == name or f[:-5] == name]
    return [os.path.join(models_dir, f) for f in exact or [f for f in candidates if name.lower() in f.lower()]]


def resolve_model(name: str, models_dir: str, aliases: Optional[Mapping[str, str]] = None) -> str:
    """The model file ``name`` means (see model_matches), or ModelError saying why none."""
    matches = model_matches(name, models_dir, aliases)
    if len(matches) == 1:
        return matches[0]
    target = (aliases or {}).get(name, name)
    shown = name if target == name else f"{name} (an alias of {target})"
    if os.path.exists(target) or os.sep in target:
        raise ModelError(f"model {shown} does not exist")
    candidates = gguf_files(models_dir)
    if candidates is None:
        raise ModelError(f"model {shown} does not exist, and models dir {models_dir} cannot be read "
                         "(NRVNA_MODELS_DIR)")
    if not matches:
        raise ModelError(f"model {shown} does not exist; models in {models_dir}: {', '.join(candidates) or 'none'}")
    raise ModelError(f"model name {shown} is ambiguous in {models_dir}: "
                     f"{', '.join(os.path.basename(m) for m in matches)}")


# ============================================================================
# 7.5 Idempotency keys and tags
# ============================================================================
# keys/ maps a submit's key to its one job (a link, and a holder's file while it publishes);
# tags/ lists the jobs of a tag, and the --shard it was created with. Invariant: one key names one
# job however many submits race; a tag's list may name jobs since removed (readers check).


# A key written by an older nrvna names no holder: its client's life cannot be proven, so its
# key is replaced once it is this old (those clients published within a second of their key).
KEY_PENDING_SECONDS = 30.0
KEY_WAIT_NOTICE_SECONDS = 2.0  # a submit waiting on another live one says so after this long
HOLDER_PATTERN = re.compile(r"\.holder-[0-9]+-[0-9a-f]{8}")
# The largest tag index file a submit writes is one chunk of 2,000 rows, each a job ID and a
# custom_id of at most 512 characters (6 bytes each as JSON at worst): under 7 MB. Read no more.
TAG_INDEX_BYTES = 16 << 20
SHARD_RECORD = "shard"  # tags/<tag>/shard: "I/N", the --shard a batch's tag was created with


def dedupe_key(prompt: Any, params: Mapping[str, Any]) -> str:
    """An idempotency key from a job's content: the prompt (or texts, or messages) and every
    parameter but its names (``custom_id``, ``tag``) and key, so identical work shares it."""
    import hashlib
    import json

    text = prompt.decode("utf-8") if isinstance(prompt, bytes) else prompt
    content = {k: v for k, v in params.items() if k not in ("custom_id", "tag", "idempotency_key", "metadata")}
    blob = json.dumps([text, content], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _key_path(workspace: str, key: str) -> str:
    import hashlib

    return os.path.join(workspace, KEYS, hashlib.sha256(key.encode("utf-8")).hexdigest())


def _keys_folder(workspace: str) -> str:
    folder = os.path.join(workspace, KEYS)
    try:
        os.mkdir(folder, DIR_MODE)
        os.chmod(folder, DIR_MODE)
        fsync_dir(workspace)
    except FileExistsError:
        pass
    return folder


class _KeyHolder:
    """Proof that a submitter lives while it may still publish jobs whose keys it wrote: an
    exclusive flock on keys/.holder-<pid>-<random>, taken before its first key names the file
    and released only once its last job is published or given up. Another client replaces a
    key whose job is not there only when that lock is free: the kernel frees it when its
    process dies, never while the process lives, however long it is stopped (SIGSTOP) or slow.
    A time limit cannot tell those apart, and replacing a live client's key made two jobs."""

    def __init__(self, workspace: str) -> None:
        import fcntl

        self.name = f".holder-{os.getpid()}-{os.urandom(4).hex()}"
        self.path = os.path.join(_keys_folder(workspace), self.name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            write_all(self.fd, f"{os.getpid()}\n".encode())  # for the waiting client's message
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the keys up: their jobs are published, or never will be by this process."""
        _unlink_quietly(self.path, None)
        os.close(self.fd)


def _live_holder(workspace: str, holder: Optional[str], age: float) -> Optional[int]:
    """The pid of the live client that may still publish a key's staged job (0: alive, pid
    unknown), or None when no client can: the key's holder lock is free, or its file gone."""
    import fcntl

    if holder is None:  # an older nrvna's key: no lock to test, only its age
        return 0 if age < KEY_PENDING_SECONDS else None
    try:
        fd = os.open(os.path.join(workspace, KEYS, holder), os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
    except OSError:
        return None  # its client finished (or died, and clean removed the file); or not a holder's file
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: clients testing it never block each other
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else 0
        return None
    finally:
        os.close(fd)


def _key_job_state(workspace: str, job_id: str, holder: Optional[str], age: float) -> tuple[bool, Optional[int]]:
    """Whether a key's job exists (in any state); if it does not, the pid of the live client
    that may still publish it (see _live_holder), or None: it never will, the key is stale."""
    if not is_valid_id(job_id):
        return False, None
    # Staging first, then the states: the publishing rename moves it from one to the other.
    staged = os.path.isdir(os.path.join(workspace, WRITING, job_id))
    if locate_job(workspace, job_id)[0] is not Status.Missing:
        return True, None
    if not staged:
        return False, None
    pid = _live_holder(workspace, holder, age)
    if pid is not None:
        return False, pid
    # Its client can publish no more, but may have done so since the first look.
    return locate_job(workspace, job_id)[0] is not Status.Missing, None


def key_job(workspace: str, key: str, wait: Optional[float] = None,
            notify: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The ID of the job submitted with idempotency ``key``, in any state (queued, running,
    done, failed); None if there is none. A job another client is still publishing is waited
    for while that client lives (see _KeyHolder), up to ``wait`` seconds (NRVNA_KEY_WAIT),
    then KeyHeld: never a second job for the key. ``notify`` hears once, after a while, that
    the wait goes on. A key whose job is gone (cleaned), or whose client died before
    publishing it, is removed here, so the next submit queues the work again."""
    path = _key_path(workspace, key)
    wait = setting_default("key_wait") if wait is None else wait
    start = time.monotonic()
    told = False
    while True:
        try:
            job_id, holder, age = _read_key(path)
        except FileNotFoundError:
            return None
        exists, pid = _key_job_state(workspace, job_id, holder, age)
        if exists:
            return job_id
        if pid is None:
            _drop_stale_key(path, job_id)
            continue
        waited = time.monotonic() - start
        who = f"submit pid {pid}" if pid else "another submit"
        if waited >= wait:
            raise KeyHeld(f"idempotency key {key!r} is held by {who}, which is alive and has not published its job "
                          f"(stopped?); nothing queued after waiting {waited:.0f} s (NRVNA_KEY_WAIT)")
        if notify is not None and not told and waited >= KEY_WAIT_NOTICE_SECONDS:
            notify(f"waiting for {who}: it holds idempotency key {key!r} and has not published its job yet "
                   f"(stopped?); giving up after {wait:g} s (NRVNA_KEY_WAIT)")
            told = True
        time.sleep(0.01 if waited < 1 else 0.1)  # a live client publishes within a second, as a rule


def _parse_key(text: str) -> tuple[str, Optional[str]]:
    """A key file's job ID and holder (None in an older nrvna's key, which holds the ID alone)."""
    lines = text.split("\n")
    holder = lines[1].strip() if len(lines) > 1 else ""
    return lines[0].strip(), holder if HOLDER_PATTERN.fullmatch(holder) else None


def _read_key(path: str) -> tuple[str, Optional[str], float]:
    """The job ID a key names, its holder (see _KeyHolder) and the key's age in seconds. Not
    blocking, not following a link: a FIFO planted in keys/ reads as a key naming no job."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
    try:
        info = os.fstat(fd)
        text = os.read(fd, 1024).decode("utf-8", "replace") if stat.S_ISREG(info.st_mode) else ""
    finally:
        os.close(fd)
    job_id, holder = _parse_key(text)
    return job_id, holder, time.time() - info.st_mtime


def _drop_stale_key(path: str, job_id: str) -> None:
    """Remove a key naming ``job_id``, unless another client replaced it meanwhile: it is
    renamed away first (one client wins the rename), and put back if it named another job."""
    aside = f"{path}.stale-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another client removed it
    try:
        if _read_key(aside)[0] != job_id:
            try:
                os.link(aside, path)  # a fresh key, not the stale one: restore it
            except FileExistsError:
                pass
    finally:
        _unlink_quietly(aside, None)


def _link_key(workspace: str, key: str, job_id: str, holder: str) -> bool:
    """Create ``key``'s entry naming ``job_id`` and its client's ``holder`` (a _KeyHolder's
    name), durably, if no client has: False if one has. (Written under a temporary name and
    hard-linked: link() fails if the name exists.)"""
    folder = _keys_folder(workspace)
    path = _key_path(workspace, key)
    temp = f"{path}.new-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    try:
        write_all(fd, f"{job_id}\n{holder}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, path)
    except FileExistsError:
        return False
    finally:
        _unlink_quietly(temp, None)
    fsync_dir(folder)
    return True


def _prune_keys(workspace: str) -> None:
    """Delete keys whose jobs are gone (after clean), and the holder files of clients that
    died: the key store stays as large as the jobs."""
    import fcntl

    folder = os.path.join(workspace, KEYS)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(folder, name)
        if HOLDER_PATTERN.fullmatch(name):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
            except OSError:
                continue
            try:
                # A minute old: its client locks it at once, before any key names it.
                if time.time() - os.fstat(fd).st_mtime > 60:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    _unlink_quietly(path, None)
            except BlockingIOError:
                pass  # its client lives
            finally:
                os.close(fd)
            continue
        try:
            job_id, holder, age = _read_key(path)
        except OSError:
            continue  # removed meanwhile, or not a key nrvna wrote (a directory, a link): left alone
        if _key_job_state(workspace, job_id, holder, age) == (False, None):
            _drop_stale_key(path, job_id)


def tag_shard(workspace: str, tag: str) -> Optional[tuple[int, int]]:
    """The shard (I, N) ``tag`` was created with by ``submit --file --shard`` (its SHARD_RECORD),
    or None: created without --shard, or before tags recorded it. InvalidInput naming a
    record that holds no I/N (damaged, or planted)."""
    path = os.path.join(workspace, TAGS, tag, SHARD_RECORD)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise InvalidInput(f"{path}: cannot read the shard tag {tag} was created with ({_os_error(err)})") from None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError as err:
        raise InvalidInput(f"{path}: cannot read the shard tag {tag} was created with ({_os_error(err)})") from None
    finally:
        os.close(fd)
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise InvalidInput(f"{path} holds {text[:20]!r}, not the I/N of the shard tag {tag} was created with "
                           "(damaged: give the batch another --tag)")
    return int(index), int(count)


def claim_tag_shard(workspace: str, tag: str, shard: Optional[tuple[int, int]]) -> None:
    """Check a batch file's ``shard`` (None: the whole file) against the one ``tag`` was
    created with, and record it when this submit creates the tag: one tag holds one shard of
    one sharding (0/3 then 0/2 under one tag mixed two). InvalidInput naming both when they
    differ. A tag with no record (made before records, or by a submit without --shard) takes
    any shard, as before. The record is linked, never replaced: of two submits creating one
    tag at once, the second is checked against the first."""
    recorded = tag_shard(workspace, tag)
    if recorded is None:
        if shard is None or _tag_known(workspace, tag):
            return
        if _link_shard_record(workspace, tag, shard):
            return
        recorded = tag_shard(workspace, tag)  # another submit's, linked since the first look
    if recorded is not None and recorded != shard:
        given = "no --shard (the whole file)" if shard is None else f"--shard {shard[0]}/{shard[1]}"
        raise InvalidInput(f"tag {tag} was created with --shard {recorded[0]}/{recorded[1]}, this submit gives "
                           f"{given}: one tag holds one shard (give --shard {recorded[0]}/{recorded[1]} to resume it, "
                           "or another --tag)")


def _link_shard_record(workspace: str, tag: str, shard: tuple[int, int]) -> bool:
    """Write ``tag``'s SHARD_RECORD durably unless one exists (False then): a temporary file,
    fsynced, hard-linked to its name (link() never replaces)."""
    ensure_workspace(workspace)
    folder = _tag_folder(workspace, tag)
    temp = os.path.join(folder, f".{SHARD_RECORD}-{os.getpid()}-{os.urandom(4).hex()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    try:
        write_all(fd, f"{shard[0]}/{shard[1]}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, os.path.join(folder, SHARD_RECORD))
    except FileExistsError:
        return False
    finally:
        _unlink_quietly(temp, None)
    fsync_dir(folder)
    fsync_dir(os.path.dirname(folder))
    return True


def tag_members(workspace: str, tag: str) -> list[tuple[str, Optional[str]]]:
    """(id, custom_id) of every job ever submitted with ``tag``, in submission order
    (including removed or never-published ones: check their states)."""
    return [row for chunk in iter_tag_members(workspace, tag) for row in chunk]


def iter_tag_members(workspace: str, tag: str) -> Iterator[list[tuple[str, Optional[str]]]]:
    """``tag_members`` one submit chunk at a time (at most BATCH_CHUNK rows in memory)."""
    if not ID_PATTERN.fullmatch(tag):
        raise InvalidInput(f"invalid tag {tag!r}")
    for _, rows in _tag_files(workspace, tag):
        yield rows


def _tag_files(workspace: str, tag: str) -> Iterator[tuple[str, list[tuple[str, Optional[str]]]]]:
    """(file name, rows) of each index file of ``tag``, oldest first. An index file that is not
    as a submit writes it (a symlink, a FIFO, over TAG_INDEX_BYTES, not lines of ``[job ID,
    custom_id or null]``) is a WorkspaceError naming it: its tag cannot be read whole, and
    reading the rest of it would give a wrong answer (a batch `wait` ending early)."""
    import json

    folder = os.path.join(workspace, TAGS, tag)
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".ids") and not n.startswith(".")]
        dir_fd = open_dir(folder)
    except FileNotFoundError:
        return
    except OSError as err:
        raise WorkspaceError(f"tag index {folder} is unreadable: {_os_error(err)}") from None
    try:
        for name in sorted(names):
            try:
                text = read_file(dir_fd, name, TAG_INDEX_BYTES).decode("utf-8").rstrip("\n")
                rows = json.loads(f"[{text.replace(chr(10), ',')}]")  # one parse per file
            except FileNotFoundError:
                continue  # removed meanwhile (clean)
            except (OSError, ValueError, RecursionError, JobError) as err:
                why = _os_error(err) if isinstance(err, OSError) else str(err) or type(err).__name__
                raise WorkspaceError(f"tag index {folder}/{name} is unreadable: {why}") from None
            for line, row in enumerate(rows, 1):
                if not (isinstance(row, list) and len(row) == 2 and is_valid_id(row[0])
                        and (row[1] is None or isinstance(row[1], str))):
                    raise WorkspaceError(f"tag index {folder}/{name} is not nrvna's: line {line} is not "
                                         "[job ID, custom_id or null]")
            yield name, [(job_id, cid) for job_id, cid in rows]
    finally:
        os.close(dir_fd)


# ============================================================================
# 7.6 Reading a job
# ============================================================================
# Job (what Flow.get returns), the readers of logprobs.json and choices.json, and _DirWatch
# (inotify on a directory). Read only; any thread.


# Why a done job's generation ended (OpenAI's names): its end, its max_tokens, or its tool calls.
FINISH_REASONS = ("stop", "length", "tool_calls")

# The most turns a child's whole conversation may hold, counted before anything is rendered. One
# submit's messages hold at most 4,096 turns (PARAMS); a chain adds two with every child (its
# message, its answer), bounded otherwise by the model's context only. Rendering grows faster
# than the turns: on SmolLM2 16,384 turns render in about 3 s, a crafted 80,000 held a worker 2 minutes.
CONVERSATION_TURNS = 4 * 4096


class Job(namedtuple("Job", "id status prompt result error meta params logprobs choices reasoning message",
                     defaults=(None, None, None, None, None))):
    """A job as read back from the workspace: ``id: str, status: Status`` and
    ``prompt, result, error: str | None`` and ``meta, params: dict`` (params.json: the
    per-job parameters, ``custom_id`` and ``tag``) and ``logprobs``: the generated tokens'
    log-probabilities in OpenAI's shape (``[{token, logprob, bytes, top_logprobs}]``), or
    None unless the job asked for them; ``choices``: a done job of n > 1 choices has every
    one, ``[{index, text, finish_reason, generated_tokens[, logprobs]}]`` (``result`` and
    ``logprobs`` are the first's), else None; ``reasoning``: a thinking model's thinking
    (reasoning.txt), else None; ``message``: an answer of tool calls (tool_calls.json, the
    first choice's), ``{"content": str | None, "tool_calls": [{"id", "type", "function":
    {"name", "arguments"}}]}``, else None (``result`` then holds one JSON line per call)."""

    __slots__ = ()

    @property
    def tool_calls(self) -> Optional[list[dict[str, Any]]]:
        """The tool calls of its answer (the first choice's), else None."""
        return self.message["tool_calls"] if self.message else None


def _logprobs_shape(logprobs: Any) -> bool:
    """Whether ``logprobs`` has the shape nrvna writes (a hand-made or damaged file may not)."""
    return isinstance(logprobs, list) and all(isinstance(e, dict) and isinstance(e.get("bytes"), list)
                                              and isinstance(e.get("top_logprobs"), list) for e in logprobs)


def _read_choices(text: Optional[str]) -> Optional[list[dict[str, Any]]]:
    """choices.json's choices, or None (no file; a hand-made or damaged one: the job reads without)."""
    if text is None:
        return None
    import json

    try:
        choices = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(choices, list) and choices and all(
            isinstance(c, dict) and isinstance(c.get("text"), str) and c.get("finish_reason") in FINISH_REASONS
            and isinstance(c.get("generated_tokens"), int) and _logprobs_shape(c.get("logprobs", []))
            for c in choices) and [c.get("index") for c in choices] == list(range(len(choices)))):
        return None
    return choices


def _calls_shape(calls: Any) -> bool:
    """Whether ``calls`` are an assistant turn's tool calls as nrvna writes them (see _check_call)."""
    if not (isinstance(calls, list) and calls):
        return False
    try:
        for k, call in enumerate(calls):
            _check_call(call, f"tool_calls[{k}]")
    except InvalidInput:
        return False
    return True


def _read_message(text: Optional[str]) -> Optional[dict[str, Any]]:
    """tool_calls.json's ``{"content", "tool_calls"}``, or None (no file; a damaged one)."""
    message = _json_or_none(text, None)
    if not (isinstance(message, dict) and _calls_shape(message.get("tool_calls"))
            and isinstance(message.get("content"), (str, type(None)))):
        return None
    return message


def continued_turns(parent: list[dict[str, str]], own: list[dict[str, str]]) -> list[dict[str, str]]:
    """A child's turns: its parent's conversation, then its own turns; the child's own system
    message, if it has one, replaces the parent's."""
    system = [t for t in own[:1] if t["role"] == "system"] or [t for t in parent[:1] if t["role"] == "system"]
    return system + [t for t in parent if t["role"] != "system"] + [t for t in own if t["role"] != "system"]


def _turns_shape(turns: Any) -> bool:
    """Whether ``turns`` is a conversation as nrvna writes it (a hand-made file may not be)."""
    return isinstance(turns, list) and bool(turns) and all(
        isinstance(t, dict) and t.get("role") in ROLES and (isinstance(t.get("content"), str) or (
            t.get("content") is None and t.get("tool_calls") is not None))
        and (t.get("tool_calls") is None or (t["role"] == "assistant" and _calls_shape(t["tool_calls"])))
        and (t["role"] != "tool" or isinstance(t.get("tool_call_id"), str))
        and isinstance(t.get("name", ""), str) for t in turns)


def _json_or_none(text: Optional[str], missing: Any) -> Any:
    """``text`` parsed as JSON; ``missing`` for no file, None for a damaged one."""
    import json

    if text is None:
        return missing
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _ancestor_failed(workspace: str, parent: str, job_id: str, status: Status, path: str) -> JobError:
    """parent_failed for an ancestor that is not done: failed, cancelled or gone."""
    what = f"its parent {parent}" if job_id == parent else f"its parent's ancestor {job_id}"
    if status is Status.Missing:
        return JobError("parent_failed", f"{what} is gone (cleaned or removed): nothing to continue")
    code = ""
    try:
        fd = open_dir(path)
        try:
            code = str(read_meta(fd).get("code") or "")
        finally:
            os.close(fd)
    except OSError:
        pass
    import shlex

    return JobError("parent_failed", f"{what} failed{f' ({code})' if code else ''}: "
                                     f"nrvna retry {shlex.quote(workspace)} {job_id}, then this job")


def _ancestor_files(job_id: str, path: str, budget: int, limit: int) -> tuple[dict[str, Optional[str]], int]:
    """The files of the done job ``job_id`` (at ``path``) that its conversation is made of (None:
    not there, or not a regular file), and the bytes they took of ``budget``, what is left of
    ``limit``: JobError parent_failed naming a file larger than that."""
    try:
        fd = open_dir(path)
    except OSError as err:
        raise JobError("parent_failed", f"cannot read its ancestor {job_id}: {_os_error(err)}") from None
    files: dict[str, Optional[str]] = {}
    used = 0
    try:
        for name in (CONVERSATION_FILE, PROMPT_FILE, PARAMS_FILE, RESULT_FILE, TOOL_CALLS_FILE):
            files[name] = None
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_size > budget - used:
                    raise JobError("parent_failed", f"{os.path.join(path, name)} is {info.st_size:,} bytes: its "
                                   f"conversation is over the {limit:,} bytes a child reads (its parent's files in all)")
                data = read_file(fd, name, budget - used)
            except (FileNotFoundError, JobError) as err:
                if isinstance(err, JobError) and err.code == "parent_failed":
                    raise
                continue  # not there, a symbolic link, a FIFO: as if not written
            except OSError as err:
                raise JobError("parent_failed", f"cannot read {os.path.join(path, name)}: {_os_error(err)}") from None
            used += len(data)
            files[name] = data.decode("utf-8", "replace")
    finally:
        os.close(fd)
    return files, used


def _ancestor_turns(job_id: str, path: str, files: Mapping[str, Optional[str]], parent: bool) -> list[dict[str, Any]]:
    """The turns of the done job ``job_id`` rebuilt from its prompt, params.json and answer (its
    conversation.json missing or damaged), its own parents' left out; ``parent``: it is the
    child's parent (else an ancestor further up)."""
    params = _json_or_none(files[PARAMS_FILE], {})
    if not isinstance(params, dict) or files[PROMPT_FILE] is None or files[RESULT_FILE] is None:
        raise JobError("parent_failed", f"its ancestor {job_id} cannot be read (no prompt, result or "
                                        "valid params.json)")
    if job_param(params, "raw") or job_param(params, "embed"):
        raise JobError("bad_request", f"its {'parent' if parent else 'ancestor'} {job_id} is "
                                      f"{'a raw' if job_param(params, 'raw') else 'an embed'} job: no turns to continue")
    try:  # the parameters its turns are made of, as a submit checks them (the file may be hand-made)
        own = {key: PARAMS[key].validate(key, params[key]) for key in ("messages", "system")
               if params.get(key) is not None}
    except InvalidInput as err:
        raise JobError("parent_failed", f"{os.path.join(path, PARAMS_FILE)}: {err}") from None
    return conversation_turns(files[PROMPT_FILE], own, files[RESULT_FILE], _read_message(files[TOOL_CALLS_FILE])) or []


def parent_conversation(workspace: str, parent: str, limit: int = 1 << 30) -> Optional[list[dict[str, Any]]]:
    """The conversation a child of ``parent`` continues: the parent's conversation.json, or,
    for a parent finished before that file existed (or with a damaged one), its turns rebuilt
    through its own parents. None while the parent is queued or running. JobError
    ``parent_failed`` for a failed, cancelled or missing ancestor, and for files that cost too
    much before anything is rendered (over ``limit`` bytes read in all, over CONVERSATION_TURNS
    turns) or loop (params.json naming an ancestor as parent), naming the file; ``bad_request``
    for an ancestor with no turns (raw, embed)."""
    chain: list[list[dict[str, Any]]] = []  # each ancestor's own turns, the parent's first
    base: list[dict[str, Any]] = []
    seen: dict[str, str] = {}  # an ancestor -> its directory
    job_id: Optional[str] = parent
    budget, count, child = limit, 0, ""
    while job_id is not None:
        if job_id in seen:
            raise JobError("parent_failed", f"its chain of parents loops: {os.path.join(seen[child], PARAMS_FILE)} "
                                            f"names {job_id} as its parent, which descends from it (a hand-made file)")
        status, path = locate_job(workspace, job_id)
        if status in (Status.Queued, Status.Running):
            if job_id == parent:
                return None
            raise JobError("parent_failed", f"its ancestor {job_id} is {status.value} again (retried): "
                                            "retry this job once it is done")
        if status is not Status.Done:
            raise _ancestor_failed(workspace, parent, job_id, status, path)
        seen[job_id] = path
        files, used = _ancestor_files(job_id, path, budget, limit)
        budget -= used
        turns = _json_or_none(files[CONVERSATION_FILE], None)
        if isinstance(turns, list) and count + len(turns) > CONVERSATION_TURNS:
            raise JobError("parent_failed", f"{os.path.join(path, CONVERSATION_FILE)} holds {len(turns):,} turns: "
                                            f"with its children's, over the {CONVERSATION_TURNS:,} a conversation may hold")
        if _turns_shape(turns):
            base = turns
            break
        chain.append(_ancestor_turns(job_id, path, files, job_id == parent))
        count += len(chain[-1])
        if count > CONVERSATION_TURNS:
            raise JobError("parent_failed", f"its ancestors' turns, rebuilt up to {job_id}, are over the "
                                            f"{CONVERSATION_TURNS:,} a conversation may hold")
        params = _json_or_none(files[PARAMS_FILE], {})
        child, job_id = job_id, (params.get("parent") if isinstance(params.get("parent"), str) else None)
    for own in reversed(chain):
        base = continued_turns(base, own) if base else own
    return base


class _DirWatch:
    """inotify on one directory (Linux, through ctypes): which names were moved or created."""

    IN_CREATE, IN_MOVED_TO, IN_Q_OVERFLOW, IN_ONLYDIR = 0x100, 0x80, 0x4000, 0x01000000

    def __init__(self, path: str) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = self.IN_CREATE | self.IN_MOVED_TO | self.IN_ONLYDIR
        if libc.inotify_add_watch(self.fd, os.fsencode(path), mask) < 0:
            code = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(code, f"inotify_add_watch failed: {os.strerror(code)}")

    def fileno(self) -> int:
        return self.fd

    def read(self) -> tuple[list[tuple[int, str]], bool]:
        """Pending events as (mask, name), and whether the kernel dropped some."""
        import struct

        events, overflow = [], False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return events, overflow
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16:offset + 16 + length].rstrip(b"\0")
                offset += 16 + length
                if mask & self.IN_Q_OVERFLOW:
                    overflow = True
                elif name:
                    events.append((mask, os.fsdecode(name)))

    def close(self) -> None:
        os.close(self.fd)


# ============================================================================
# 7.7 Saved states on disk: the file format
# ============================================================================
# A saved KV state (StateStore, §11.6) is one file, states/HASH.kv: magic, header length, JSON header
# (fingerprint, job, owner, counts: checked against the file's size first), tokens (int32 LE), the
# per-sequence state, a crc32. Written whole: torn or damaged, it is a miss. Only a file with the magic
# (a temporary one: named exactly as nrvna names it) is nrvna's to touch. Stateless; any thread.


STATES = "states"  # the workspace's folder of saved KV states (NRVNA_CACHE_DIR names another)
STATE_MAGIC = b"NRVNAKV1"
STATE_SUFFIX = ".kv"
STATE_TEMP_PREFIX = ".tmp-"
STATE_TEMP = re.compile(r"\.tmp-([0-9]{1,10})-[0-9a-f]{40}\.kv\.part")  # a save's temporary file (the writer's pid)
STATE_HEADER_LIMIT = 1 << 16
STATE_TOKENS_LIMIT = 1 << 24  # most tokens a state covers (NRVNA_CACHE_MIN_TOKENS's own bound; no context is longer)

# A saved state as its header describes it: its file name, fingerprint, source job, the tokens
# it covers (an array of int32), the state's length in bytes, the file's size and mtime, and its
# owner (state_owner: the workspace whose daemon wrote it; "" in a state saved before owners were).
StateHead = namedtuple("StateHead", "name fingerprint job tokens blob size mtime owner", defaults=("",))


def _is_state_name(name: str) -> bool:
    """A saved state's file name (a temporary one, hidden, is not)."""
    return name.endswith(STATE_SUFFIX) and not name.startswith(".")


def states_folder(workspace: str, cache_dir: str = "") -> str:
    """Where a workspace's saved states live: NRVNA_CACHE_DIR, else its states/."""
    return cache_dir or os.path.join(workspace, STATES)


def state_owner(workspace: str) -> str:
    """Who a state saved by ``workspace``'s daemons belongs to, in its header: a hash of the
    workspace's real path (a folder shared by workspaces names none of their paths). A daemon's
    NRVNA_CACHE_DISK bound counts and evicts its own workspace's states only."""
    import hashlib

    return hashlib.sha256(os.path.realpath(workspace).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _le_tokens(tokens: Any) -> bytes:
    from array import array

    tokens = array("i", tokens)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tobytes()


def state_name(fingerprint: str, tokens: Any) -> str:
    """A state's file name: it names its content (two daemons saving the same context write the
    same state under the same name)."""
    import hashlib

    return hashlib.sha256(fingerprint.encode("utf-8") + b"\0" + _le_tokens(tokens)).hexdigest()[:40] + STATE_SUFFIX


def state_temp_name(name: str) -> str:
    """The temporary name a state is written under before its rename (matches STATE_TEMP)."""
    return f"{STATE_TEMP_PREFIX}{os.getpid()}-{name}.part"


def state_buffer(fingerprint: str, job_id: str, tokens: Any, blob: int, owner: str = "") -> tuple[Any, int]:
    """A state file's bytes but its state and crc: the buffer (writable, an anonymous mapping)
    and where the state goes."""
    import json
    import mmap
    import struct

    header = json.dumps({"fingerprint": fingerprint, "job": job_id, "tokens": len(tokens), "blob": blob,
                         "created": round(time.time(), 3), **({"owner": owner} if owner else {})}).encode("utf-8")
    head = STATE_MAGIC + struct.pack("<I", len(header)) + header + _le_tokens(tokens)
    data = mmap.mmap(-1, len(head) + blob + 4)  # anonymous: pages zeroed lazily (a bytearray memsets 184 MB)
    data[:len(head)] = head
    return data, len(head)


def seal_state(data: Any) -> None:
    """Write the crc32 of everything before the last 4 bytes into them."""
    import struct
    import zlib

    data[-4:] = struct.pack("<I", zlib.crc32(memoryview(data)[:-4]))


def _count(value: Any) -> bool:
    """A header's count: an int (never a bool, a float or text), 0 or more."""
    return type(value) is int and value >= 0


def inspect_state(folder: str, name: str) -> tuple[Optional[StateHead], str]:
    """A state file's header and tokens (not its state), or None and why: "foreign" (no
    nrvna magic, not a regular file: not nrvna's, left alone), "damaged" (nrvna's magic, and
    counts that do not fit the file: torn, damaged or crafted; nrvna's to remove) or
    "unreadable" (it could not be read now: EMFILE, EACCES, EIO...; never a reason to remove).
    Every count is checked against the file's size before it is used."""
    import errno
    import json
    import struct
    from array import array

    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        return None, "foreign" if err.errno == errno.ELOOP else "unreadable"  # ELOOP: a symlink
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "foreign"
        start = os.pread(fd, len(STATE_MAGIC) + 4, 0)
        if start[:len(STATE_MAGIC)] != STATE_MAGIC:
            return None, "foreign"
        length = struct.unpack("<I", start[8:])[0] if len(start) == 12 else -1
        if not 0 < length <= min(STATE_HEADER_LIMIT, info.st_size - 16):
            return None, "damaged"
        header = json.loads(os.pread(fd, length, 12))
        if not (isinstance(header, dict) and isinstance(header.get("fingerprint"), str)
                and _count(header.get("tokens")) and _count(header.get("blob"))):
            return None, "damaged"
        n, blob = header["tokens"], header["blob"]
        if n > STATE_TOKENS_LIMIT or 12 + length + 4 * n + blob + 4 != info.st_size:
            return None, "damaged"
        raw = os.pread(fd, 4 * n, 12 + length)
        if len(raw) != 4 * n:
            return None, "damaged"
        tokens = array("i", raw)
        if sys.byteorder != "little":
            tokens.byteswap()
        job = header.get("job") if isinstance(header.get("job"), str) else ""
        owner = header.get("owner") if isinstance(header.get("owner"), str) else ""
        return StateHead(name, header["fingerprint"], job, tokens, blob, info.st_size, info.st_mtime, owner), ""
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        return None, "damaged"
    except (OSError, MemoryError):
        return None, "unreadable"
    finally:
        os.close(fd)


def read_state_head(folder: str, name: str) -> Optional[StateHead]:
    """A state file's header and tokens (not its state); None for anything that is not a
    whole state file of this format (a torn, damaged or foreign file: see inspect_state)."""
    return inspect_state(folder, name)[0]


def map_state(folder: str, head: StateHead) -> Optional[Any]:
    """A state file mapped whole (copy-on-write: ctypes may point into it; the page cache is
    read, never copied), or None when it is not the file ``head`` describes (another size, no
    nrvna magic). OSError when it cannot be opened or mapped (FileNotFoundError: gone)."""
    import mmap

    fd = os.open(os.path.join(folder, head.name), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != head.size:
            return None
        mapped = mmap.mmap(fd, head.size, access=mmap.ACCESS_COPY)
    except ValueError:  # an empty file
        return None
    finally:
        os.close(fd)
    if mapped[:len(STATE_MAGIC)] != STATE_MAGIC:
        mapped.close()
        return None
    return mapped


def state_whole(mapped: Any) -> bool:
    """Whether a mapped state file's crc32 matches (zlib releases the GIL: it can run beside the
    restore that reads the same pages)."""
    import struct
    import zlib

    view = memoryview(mapped)
    try:
        return struct.unpack("<I", view[-4:])[0] == zlib.crc32(view[:-4])
    finally:
        view.release()


def read_state(folder: str, head: StateHead) -> Optional[Any]:
    """A state file mapped and checked against its crc; None for a torn, damaged, changed or
    unreadable file."""
    try:
        mapped = map_state(folder, head)
    except OSError:
        return None
    if mapped is None or not state_whole(mapped):
        return None
    return mapped


def remove_states_of(folder: str, job_ids: set[str]) -> int:
    """Remove the saved states whose source job is one of ``job_ids`` (clean); how many. Only
    whole states (nrvna's magic, counts that fit) are read: any other file is left."""
    removed = 0
    try:
        names = [n for n in os.listdir(folder) if _is_state_name(n)]
    except OSError:
        return 0
    for name in names:
        head = read_state_head(folder, name)
        if head is not None and head.job in job_ids:
            try:
                os.unlink(os.path.join(folder, name))
                removed += 1
            except OSError:
                pass
    return removed


##############################################################################
# 8. Batch files and export: nrvna's JSONL lines, OpenAI Batch lines (ENDPOINTS), export formats (EXPORT_FORMATS)
##############################################################################
# Owns batch lines (nrvna's and OpenAI's), data templates, the export formats and merge. Invariant: a
# batch file is checked whole before any job of it is queued. Client code; stateless.


# ============================================================================
# 8.1 Batch files
# ============================================================================
# nrvna's JSONL lines, OpenAI Batch request lines, plain prompt lines and data templates, as
# BatchEntry records; shards (shard_of). Invariant: a file is read with a bound per line, and
# checked whole before any of it is queued.


BATCH_CHUNK = 2000  # jobs staged, flushed once and published together by Work.publish_batch
SHARDS_MAX = 1 << 20  # most shards a batch may be split into (--shard I/N)
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")
# The fields an nrvna JSONL line may carry: its prompt, and every job parameter but tag and endpoint.
_JSONL_FIELDS = ("prompt", *(name for name, param in PARAMS.items() if param.jsonl))


# OpenAI body fields accepted besides the job parameters' own (PARAMS[...].openai).
OPENAI_BODY_EXTRA = {"prompt": "the input of /v1/completions", "stream": "must be false",
                     "functions": "the legacy form of tools", "function_call": "the legacy form of tool_choice"}


def shard_of(custom_id: str, shards: int) -> int:
    """Which of ``shards`` shards a line is in: from a hash of its ``custom_id`` (``line-N``
    where it has none) that every machine and Python computes alike (sha256, never hash()),
    so each node takes its share of one file with no coordination."""
    import hashlib

    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def read_shard(text: str) -> tuple[int, int]:
    """``I/N`` (0 <= I < N): shard I of N, as --shard gives it."""
    index, _, count = text.partition("/")
    try:
        shard, shards = int(index), int(count)
    except ValueError:
        raise InvalidInput(f"--shard {text!r} is not I/N (e.g. --shard 0/3, or "
                           "--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)") from None
    if not (1 <= shards <= SHARDS_MAX and 0 <= shard < shards):
        raise InvalidInput(f"--shard {text}: I must be 0 to N-1 and N 1 to {SHARDS_MAX}")
    return shard, shards


class BatchEntry(namedtuple("BatchEntry", "line prompt params")):
    """One job of a batch file: its line number, prompt bytes (what prompt.txt holds) and
    validated params (``custom_id`` always set)."""

    __slots__ = ()


def batch_line_limit() -> int:
    """The longest line a batch file may have: a job's params.json at its largest
    (``params_limit``) and its prompt with every character escaped (6 bytes: \\u0001);
    14 × NRVNA_MAX_PROMPT_BYTES + 8 MiB, 22 MiB by default."""
    prompt = setting_default("max_prompt_bytes")
    return params_limit(prompt) + 6 * prompt


def read_batch(handle: Any) -> bytearray:
    """A batch file's bytes from the binary stream ``handle``, a line at a time: a line longer
    than ``batch_line_limit`` is refused as soon as that much of it is read (a file with no
    newline, /dev/zero, took gigabytes whole), and a file of more than NRVNA_MAX_BATCH_LINES
    lines at the line past it (`yes | nrvna submit ws --file -` grew without end): the file is
    held whole, as every line is checked before any is queued."""
    data = bytearray()
    for _, line in _bounded_lines(handle, batch_line_limit(), "a batch line's limit (14 × NRVNA_MAX_PROMPT_BYTES + 8 MiB)",
                                  "a batch file holds"):
        data += line
    return data


def _bounded_lines(handle: Any, limit: int, limit_name: str, holder: str) -> Iterator[tuple[int, bytes]]:
    """(number, line) of ``handle``'s lines, InvalidInput at a line over ``limit`` bytes (read
    no further than that) or past NRVNA_MAX_BATCH_LINES lines."""
    most = setting_default("max_batch_lines")
    number = 0
    while True:
        line = handle.readline(limit + 2)  # the line, its newline, and one byte more shows it is over
        if not line:
            return
        number += 1
        if number > most:
            raise InvalidInput(f"line {number}: {holder} at most {most:,} lines (NRVNA_MAX_BATCH_LINES): split it")
        if len(line) - line.endswith(b"\n") > limit:
            raise InvalidInput(f"line {number}: over {limit} bytes, {limit_name}")
        yield number, line


def parse_batch(data: bytes, jsonl: Optional[bool] = None, notes: Optional[list[str]] = None) -> list[BatchEntry]:
    """Parse and validate a whole batch file; raise InvalidInput naming the first bad line.

    JSONL (``jsonl`` True, or None and every non-empty line a JSON object): nrvna's lines
    ``{"prompt"|"messages", "custom_id"?, params...}`` or OpenAI Batch request lines. Otherwise
    one prompt per non-empty line. A line without a custom_id gets ``line-N``.
    """
    import json

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise InvalidInput(f"line {line}: not valid UTF-8") from None
    lines = [(n, raw) for n, raw in enumerate(text.split("\n"), 1) if raw.strip()]
    if not lines:
        raise InvalidInput("the file has no prompts")
    if jsonl is None:
        jsonl = all(raw.lstrip().startswith("{") for _, raw in lines) and _all_objects(lines)
    limit = setting_default("max_prompt_bytes")
    entries, seen = [], {}
    for n, raw in lines:
        try:
            if jsonl:
                try:
                    obj = json.loads(raw)
                except ValueError as err:
                    raise InvalidInput(f"invalid JSON ({err.msg} at column {err.colno})") from None
                except RecursionError:
                    raise InvalidInput("JSON nested too deeply") from None
                prompt, params = _batch_line(obj, notes)
            else:
                prompt, params = raw.rstrip("\r"), {}
            params.setdefault("custom_id", f"line-{n}")
            params = validate_params(params)
            data_bytes = check_prompt(prompt, limit)
        except InvalidInput as err:
            raise InvalidInput(f"line {n}: {err}") from None
        cid = job_param(params, "custom_id")
        if cid in seen:
            raise InvalidInput(f"line {n}: duplicate custom_id {cid!r} (first on line {seen[cid]})")
        seen[cid] = n
        entries.append(BatchEntry(n, data_bytes, params))
    return entries


def compile_template(text: str) -> list[tuple[str, Optional[str]]]:
    """A template as (literal text, field name or None) parts: ``{name}`` is a record's field,
    ``{{`` and ``}}`` are literal braces. Raise InvalidInput for a brace that is neither."""
    parts: list[tuple[str, Optional[str]]] = []
    literal: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in "{}" and text[i + 1:i + 2] == char:
            literal.append(char)
            i += 2
        elif char == "}":
            raise InvalidInput(f"template: a lone '}}' at character {i + 1} (write '}}}}' for a brace)")
        elif char == "{":
            end = text.find("}", i + 1)
            name = text[i + 1:end] if end > 0 else ""
            if end < 0 or not name.strip() or "{" in name:
                raise InvalidInput(f"template: '{{' at character {i + 1} opens no {{field}} (write '{{{{' for a brace)")
            parts.append(("".join(literal), name))
            literal = []
            i = end + 1
        else:
            literal.append(char)
            i += 1
    if not parts:
        raise InvalidInput("template: it names no {field}, so every job would be the same")
    parts.append(("".join(literal), None))
    return parts


def fill_template(parts: list[tuple[str, Optional[str]]], record: Mapping[str, Any]) -> str:
    """A record's prompt: strings as they are, any other JSON value as JSON. Raise KeyError
    naming the first field the record lacks."""
    import json

    out = []
    for literal, name in parts:
        out.append(literal)
        if name is not None:
            value = record[name]
            out.append(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
    return "".join(out)


def parse_records(data: bytes, template: str, id_field: Optional[str] = None,
                  csv: Optional[bool] = None) -> list[BatchEntry]:
    """A data file as jobs: each record (a JSONL object, or a CSV row under its header row)
    fills ``template`` and keeps its fields, but ``id_field``, as the job's ``metadata``;
    ``custom_id`` is the ``id_field`` value, else ``line-N``. ``csv`` None: CSV unless the
    first non-empty line is a JSON object. Raise InvalidInput naming the line (and field)."""
    import json

    parts = compile_template(template)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise InvalidInput(f"line {line}: not valid UTF-8") from None
    if csv is None:
        csv = not text.lstrip().startswith("{")
    records = _csv_records(text) if csv else _jsonl_records(text, json)
    limit = setting_default("max_prompt_bytes")
    entries, seen = [], {}
    for n, record in records:
        try:
            cid = f"line-{n}"
            if id_field is not None:
                value = record.get(id_field)
                if value is None or isinstance(value, (dict, list, bool)) or value == "":
                    raise InvalidInput(f"no usable id field {id_field!r} (a string or a number; --id-field)")
                cid = value if isinstance(value, str) else json.dumps(value)
            try:
                prompt = fill_template(parts, record)
            except KeyError as err:
                fields = ", ".join(record) or "none"
                raise InvalidInput(f"no field {err.args[0]!r}, which the template needs (the record has: {fields})") from None
            params = validate_params({"custom_id": cid, "metadata": {k: v for k, v in record.items() if k != id_field}})
            prompt_bytes = check_prompt(prompt, limit)
        except InvalidInput as err:
            raise InvalidInput(f"line {n}: {err}") from None
        if cid in seen:
            raise InvalidInput(f"line {n}: duplicate custom_id {cid!r} (first on line {seen[cid]})")
        seen[cid] = n
        entries.append(BatchEntry(n, prompt_bytes, params))
    if not entries:
        raise InvalidInput("the file has no records")
    return entries


def _jsonl_records(text: str, json: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError) as err:
            raise InvalidInput(f"line {n}: invalid JSON ({getattr(err, 'msg', err)})") from None
        if not isinstance(record, dict):
            raise InvalidInput(f"line {n}: a record must be a JSON object")
        yield n, record


def _csv_value(cell: str) -> Any:
    """A CSV cell as a record's value: a number when the cell is exactly how JSON writes that
    number (``5``, ``-2``, ``4.5``), so that ``"stars": 5`` comes back a number in metadata as
    it would from JSONL; else the string. Lossless: the prompt and custom_id read the same
    text. ``007``, ``1e3``, ``4.50`` and integers past 2**53 (which JSON readers in
    JavaScript round) stay strings."""
    if not _JSON_NUMBER.fullmatch(cell):
        return cell
    if "." not in cell:
        number = int(cell)
        return number if abs(number) <= 1 << 53 and str(number) == cell else cell  # "-0" stays "-0"
    value = float(cell)
    return value if repr(value) == cell else cell


def _csv_records(text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    import csv

    reader = csv.reader(text.splitlines(keepends=True), strict=True)
    header: Optional[list[str]] = None
    line = 0
    try:
        for row in reader:
            start, line = line + 1, reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            if header is None:
                header = row
                twice = sorted({name for name in row if row.count(name) > 1})
                if twice:
                    raise InvalidInput(f"line {start}: the header row names the column {twice[0]!r} twice")
                if "" in row:
                    raise InvalidInput(f"line {start}: the header row has an empty name")
                continue
            if len(row) != len(header):
                raise InvalidInput(f"line {start}: {len(row)} cells; the header row has {len(header)}")
            yield start, {name: _csv_value(cell) for name, cell in zip(header, row)}
    except csv.Error as err:
        raise InvalidInput(f"line {reader.line_num}: not valid CSV ({err})") from None
    if header is None:
        raise InvalidInput("the file has no header row")


def _all_objects(lines: list[tuple[int, str]]) -> bool:
    import json

    try:
        return all(isinstance(json.loads(raw), dict) for _, raw in lines)
    except (ValueError, RecursionError):
        return False


def _unknown_field(key: str) -> str:
    """The refusal of a field no nrvna line may carry: the likeliest meant, and the fields a line may."""
    import difflib

    if key == "tag":
        return "unknown field 'tag' (tags are given with --tag)"
    if key == "endpoint":
        return "unknown field 'endpoint' (an OpenAI Batch line's url sets it)"
    near = difflib.get_close_matches(key, _JSONL_FIELDS, n=1)
    meant = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown field {key!r}{meant} (a line's fields: {', '.join(_JSONL_FIELDS)})"


def _batch_line(obj: Any, notes: Optional[list[str]]) -> tuple[str, dict[str, Any]]:
    """(prompt text, params) of one JSONL line, in nrvna's form or OpenAI's."""
    if not isinstance(obj, dict):
        raise InvalidInput("expected a JSON object")
    if {"method", "url", "body"} & set(obj):
        return _openai_line(obj, notes)
    params = dict(obj)
    for key in params:
        if key not in _JSONL_FIELDS:
            raise InvalidInput(_unknown_field(key))
    embed = job_param(params, "embed")
    if "embed" in params and not isinstance(embed, (bool, str, list)):
        raise InvalidInput("embed must be a text, a list of texts, or true (with input or prompt)")
    if embed is True and not {"input", "prompt", "messages"} & set(params):
        raise InvalidInput("embed: true needs the texts to embed: give input or prompt (or the texts as embed)")
    if isinstance(embed, (str, list)) or (embed is True and "input" in params):
        # {"embed": "text" | ["text", ...]} (or {"embed": true, "input": [...]}): texts to embed
        if {"prompt", "messages"} & set(params) or (embed is not True and "input" in params):
            raise InvalidInput("give the texts to embed once: in embed, or as input with embed: true")
        params["embed"] = True
        return _embed_input(check_inputs(params.pop("input", embed), PARAMS["input"].high), params)
    prompt, messages = params.pop("prompt", None), job_param(params, "messages")
    if (prompt is None) == (messages is None):
        raise InvalidInput("give exactly one of prompt or messages")
    if messages is not None:
        params["messages"] = _check_messages(messages, PARAMS["messages"])
        return render_messages(job_param(params, "messages")), params
    if not isinstance(prompt, str):
        raise InvalidInput("prompt must be a string")
    return prompt, params


def _embed_input(texts: list[str], params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(prompt text, params) of an embed job: one text is the prompt itself; several are
    params' ``input``, and the prompt is their rendering."""
    if len(texts) == 1:
        return texts[0], params
    params["input"] = texts
    return render_inputs(texts), params


def _legacy_functions(body: dict[str, Any]) -> dict[str, Any]:
    """A body with OpenAI's legacy ``functions``/``function_call`` as ``tools``/``tool_choice``
    (the answer comes back as tool_calls, as llama-server's does)."""
    if "functions" not in body and "function_call" not in body:
        return body
    if "tools" in body or "tool_choice" in body:
        raise InvalidInput("give tools and tool_choice, or the legacy functions and function_call, not both")
    body = dict(body)
    functions, call = body.pop("functions", None), body.pop("function_call", None)
    if functions is not None:
        if not isinstance(functions, list):
            raise InvalidInput("functions must be a list of functions")
        body["tools"] = [{"type": "function", "function": f} for f in functions]
    if call is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": call.get("name")}}
                               if isinstance(call, dict) and set(call) == {"name"} else call)
    return body


def _openai_line(obj: dict[str, Any], notes: Optional[list[str]]) -> tuple[str, dict[str, Any]]:
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise InvalidInput(f"unknown field {sorted(unknown)[0]!r} in an OpenAI Batch line")
    if obj.get("method", "POST") != "POST":
        raise InvalidInput("method must be POST")
    url, body = obj.get("url"), obj.get("body")
    if url not in ENDPOINTS:
        raise InvalidInput(f"url {url!r} is not supported (use {' or '.join(ENDPOINTS)})")
    if not isinstance(body, dict):
        raise InvalidInput("body must be a JSON object")
    if "custom_id" not in obj:
        raise InvalidInput("an OpenAI Batch line needs a custom_id")
    body = _legacy_functions(body)
    for key in body:
        if key not in OPENAI_FIELDS and key not in OPENAI_BODY_EXTRA:
            raise InvalidInput(f"body field {key!r} is not supported by nrvna")
    if body.get("stream", False) is not False:
        raise InvalidInput("body field 'stream' must be false")
    endpoint = ENDPOINTS[url]
    params: dict[str, Any] = {"custom_id": obj["custom_id"], "endpoint": url}
    if endpoint.input == "input":  # /v1/embeddings
        if {"prompt", "messages"} & set(body) or "input" not in body:
            raise InvalidInput(f"a {url} body needs input (a string or a list of strings), and no prompt or messages")
        params["embed"] = True
        for field, name in OPENAI_FIELDS.items():
            if field in body and field != "input":
                params[name] = body[field]
        return _embed_input(check_inputs(body["input"], PARAMS["input"].high), params)
    for field, name in OPENAI_FIELDS.items():  # in table order: max_completion_tokens wins over max_tokens
        if field in body and field != endpoint.input:
            value = body[field]
            params[name] = [value] if name == "stop" and isinstance(value, str) else value  # OpenAI's stop may be one string
    if endpoint.input == "prompt":
        # The legacy completions API's logprobs is a count: how many of the likeliest tokens.
        count = body.get("logprobs")
        if "top_logprobs" in body:
            raise InvalidInput(f"body field 'top_logprobs' is not a {url} field (its logprobs is a count)")
        if count is None or count is False:
            params.pop("logprobs", None)
        elif isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 5:
            raise InvalidInput(f"body field 'logprobs' of {url} must be an integer from 0 to 5")
        else:
            params.update(logprobs=True, top_logprobs=count)
        if "messages" in body or not isinstance(body.get("prompt"), str):
            raise InvalidInput(f"a {url} body needs a string prompt")
        params["raw"] = endpoint.raw
        return body["prompt"], params
    if "prompt" in body or "messages" not in body:
        raise InvalidInput(f"a {url} body needs messages")
    params["messages"] = _check_messages(body["messages"], PARAMS["messages"])
    return render_messages(job_param(params, "messages")), params


# ============================================================================
# 8.2 Export and merge
# ============================================================================
# A finished job as an export line (EXPORT_FORMATS), written whole or not at all (_ExportTarget),
# and the shards' exports put back together (merge_parts). Invariant: each JSON line says which
# request it answers (REQUEST_KEY), and merge takes no line that answers another.


# What a request is, to merge: the fields of a job no submit flag can set (each node's flags may
# differ; a line's own text may not), beside its prompt (prompt.txt). custom_id names, not asks.
REQUEST_FIELDS = tuple(name for name, param in PARAMS.items() if param.flag is None and name != "custom_id")
REQUEST_KEY = "request_sha256"  # an export line's request_digest: which request it answers


class ExportFormat(namedtuple("ExportFormat", "record line help side", defaults=(None,))):
    """An export format: the job as a JSON record (None for plain text), the job as what is
    written (bytes for a binary format), its help, and for a binary format the lines of its
    side file (``FILE.ids``: what each row is)."""

    __slots__ = ()


def job_vectors(job: Job) -> list[list[float]]:
    """A done embed job's vectors, one per text, from its result (one JSON array per line).
    Raise NotFinished for a queued or running job (``Flow.wait`` first), NrvnaError for a
    failed one, InvalidInput for a job that is not an embed job: never a complaint about
    result.txt, which such a job does not yet (or ever) hold vectors in."""
    import json

    if not job.status.finished:
        raise NotFinished(f"job {job.id} is {job.status.value}, not finished: its vectors come when it is done "
                          "(wait for it first: Flow.wait, nrvna wait)")
    if job.status is Status.Failed:
        reason = (job.error or "").strip().splitlines()
        raise NrvnaError(f"job {job.id} failed, so it has no vectors" + (f": {reason[0]}" if reason else ""))
    if not job_param(job.params or {}, "embed"):
        raise InvalidInput(f"job {job.id} is not an embed job: it has text, not vectors")
    try:
        vectors = [json.loads(line) for line in (job.result or "").splitlines() if line.strip()]
    except (ValueError, RecursionError):
        vectors = None
    if not vectors or not all(isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)
                              for v in vectors):
        raise WorkspaceError(f"job {job.id}: result.txt does not hold its vectors (one JSON array of numbers per line)")
    return vectors


def _float32_bytes(vector: list[float]) -> bytes:
    """A vector as little-endian float32 (OpenAI's base64 embeddings, export --format f32)."""
    import array

    row = array.array("f", vector)
    if sys.byteorder == "big":
        row.byteswap()
    return row.tobytes()


def request_digest(prompt: Any, params: Mapping[str, Any]) -> str:
    """Which request a result answers, as sha256 hex: of the prompt as prompt.txt holds it and
    the REQUEST_FIELDS of ``params`` (messages, input, endpoint, encoding_format). A batch line
    queued on two machines gives the same digest whatever flags each gave; a line whose prompt,
    turns or texts changed, or a line of another batch, another. Export writes it (REQUEST_KEY)
    and merge checks it against its input's line of that custom_id."""
    import hashlib
    import json

    text = prompt if isinstance(prompt, bytes) else str(prompt).encode("utf-8", "surrogatepass")
    fields = {name: params[name] for name in REQUEST_FIELDS if params.get(name) is not None}
    blob = json.dumps(fields, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(len(text).to_bytes(8, "big") + text + blob.encode("utf-8", "surrogatepass")).hexdigest()


def _request_of(job: Job) -> dict[str, str]:
    """An export line's REQUEST_KEY: the digest of the request the job answers (none when its
    prompt.txt is gone), which merge checks against its input's line."""
    return {} if job.prompt is None else {REQUEST_KEY: request_digest(job.prompt, job.params or {})}


def _jsonl_record(job: Job) -> dict[str, Any]:
    params = job.params or {}
    embedded = job.status is Status.Done and job_param(params, "embed")
    record = {"id": job.id, "custom_id": job_param(params, "custom_id"), **_request_of(job), "status": job.status.value,
              "prompt": job.prompt, "result": None if embedded else job.result,
              "error": job.error.rstrip("\n") if job.error else None, "meta": job.meta}
    if embedded:
        record["embeddings"] = job_vectors(job)
    if job.logprobs is not None:
        record["logprobs"] = job.logprobs
    if job.choices is not None:
        record["choices"] = job.choices
    if job.reasoning is not None:
        record["reasoning"] = job.reasoning
    if job.message is not None:
        record["content"], record["tool_calls"] = job.message["content"], job.message["tool_calls"]
    if job_param(params, "metadata") is not None:
        record["metadata"] = job_param(params, "metadata")
    return record


def _embeddings_body(job: Job) -> dict[str, Any]:
    """Exactly OpenAI's embeddings response body."""
    import base64

    tokens = int(job.meta.get("prompt_tokens") or 0)
    as_text = job_param(job.params or {}, "encoding_format") == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(_float32_bytes(vector)).decode("ascii") if as_text else vector}
            for i, vector in enumerate(job_vectors(job))]
    return {"object": "list", "data": data, "model": job.meta.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _openai_record(job: Job) -> dict[str, Any]:
    meta, params = job.meta, job.params or {}
    line: dict[str, Any] = {"id": f"batch_req_{job.id}", "custom_id": job_param(params, "custom_id"), **_request_of(job)}
    if job.status is not Status.Done:
        line["response"] = None
        line["error"] = {"code": meta.get("code") or "failed", "message": (job.error or "").rstrip("\n")}
        return line
    if job_param(params, "embed"):
        line["response"] = {"status_code": 200, "request_id": job.id, "body": _embeddings_body(job)}
        line["error"] = None
        return line
    prompt_tokens, completion_tokens = int(meta.get("prompt_tokens") or 0), int(meta.get("generated_tokens") or 0)
    endpoint = ENDPOINTS[job_param(params, "endpoint") or "/v1/chat/completions"]
    results = job.choices or [{"index": 0, "text": job.result, "finish_reason": meta.get("finish_reason"),
                               "logprobs": job.logprobs, **(job.message or {})}]
    choices = []
    for result in results:
        finish_reason = result.get("finish_reason") if result.get("finish_reason") in FINISH_REASONS else "stop"
        logprobs = result.get("logprobs")
        if endpoint.input == "prompt":
            choices.append({"text": result["text"], "index": result["index"],
                            "logprobs": _legacy_logprobs(logprobs, job.prompt or ""), "finish_reason": finish_reason})
        else:
            message = {"role": "assistant", "content": result["text"], "refusal": None}
            if result.get("tool_calls"):
                message.update(content=result.get("content"), tool_calls=result["tool_calls"])
            reasoning = result.get("reasoning", job.reasoning if result["index"] == 0 else None)
            if reasoning:  # llama-server's and DeepSeek's name, which most clients read
                message["reasoning_content"] = reasoning
            choices.append({"index": result["index"], "message": message,
                            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                            "finish_reason": finish_reason})
    body = {"id": f"{endpoint.id_prefix}{job.id}", "object": endpoint.object,
            "created": int(meta.get("finished") or time.time()), "model": meta.get("model"), "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "completion_tokens_details": {"reasoning_tokens": int(meta.get("reasoning_tokens") or 0)}},
            "system_fingerprint": None}
    line["response"] = {"status_code": 200, "request_id": job.id, "body": body}
    line["error"] = None
    return line


def _legacy_logprobs(content: Optional[list[dict[str, Any]]], prompt: str) -> Optional[dict[str, Any]]:
    """Log-probabilities in the shape of OpenAI's legacy completions (text_completion): each
    token's character offset counts from the prompt's start, as OpenAI's do, and its
    top_logprobs always hold the sampled token."""
    if content is None:
        return None
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split over tokens counts once
    offsets, offset, tops = [], len(prompt), []
    try:
        for entry in content:
            offsets.append(offset)
            offset += len(decoder.decode(bytes(entry["bytes"])))
            top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
            top.setdefault(entry["token"], entry["logprob"])
            tops.append(top)
        return {"tokens": [e["token"] for e in content], "token_logprobs": [e["logprob"] for e in content],
                "top_logprobs": tops, "text_offset": offsets}
    except (KeyError, TypeError, ValueError):  # a hand-made logprobs.json: exported without them
        return None


def _text_line(job: Job) -> str:
    if job.status is not Status.Done:
        return f"[failed: {(job.error or '').strip()}]\n\n"
    texts = [choice["text"] for choice in job.choices] if job.choices else [job.result]
    return "".join(text.rstrip("\n") + "\n\n" for text in texts)


def _json_line(record: Callable[[Job], dict[str, Any]]) -> Callable[[Job], str]:
    import json

    return lambda job: json.dumps(record(job), ensure_ascii=False) + "\n"


def _f32_rows(job: Job) -> bytes:
    if not job_param(job.params or {}, "embed"):
        raise InvalidInput(f"job {job.id} is not an embed job: --format f32 exports embed jobs' vectors only")
    vectors = job_vectors(job)
    widths = sorted({len(vector) for vector in vectors})
    if len(widths) > 1:  # a daemon writes one width a job; a hand-made result may not
        raise WorkspaceError(f"job {job.id}: result.txt holds vectors of {widths[0]} and {widths[-1]} floats")
    return b"".join(_float32_bytes(vector) for vector in vectors)


def _f32_ids(job: Job) -> str:
    custom_id = job_param(job.params or {}, "custom_id") or ""
    return "".join(f"{job.id}\t{custom_id}\t{i}\n" for i in range(len(job_vectors(job))))


def export_record(job: Job, form: str) -> dict[str, Any]:
    """One finished job as an export record: nrvna's ``jsonl`` record, or exactly an OpenAI
    Batch output line (``openai``)."""
    record = EXPORT_FORMATS[form].record if form in EXPORT_FORMATS else None
    if record is None:
        raise InvalidInput(f"export format {form!r} has no JSON record (JSON formats: "
                           f"{', '.join(k for k, v in EXPORT_FORMATS.items() if v.record)})")
    return record(job)


def _written_through(path: str) -> bool:
    """Whether an export writes through ``path`` (an existing FIFO, device or socket, anything
    under /dev/ or /proc/) rather than replacing a regular file there. /dev/stdout and its
    kind name an open descriptor, which may be a file the shell opened: written through,
    appending, never replaced."""
    try:
        mode: Optional[int] = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    return (mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)) or (
        os.path.abspath(path).startswith("/dev/") or os.path.realpath(path).startswith("/proc/"))


def _workspace_of(path: str) -> Optional[str]:
    """The nrvna workspace holding ``path`` (an absolute, resolved path), if any: the
    nearest directory at or above it with the queue's layout or a lock file."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    while True:
        if os.path.isdir(os.path.join(folder, READY)) and os.path.isdir(os.path.join(folder, PROCESSING)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def part_line_limit() -> int:
    """The longest line merge reads from a part: an export line repeats its request (at most a
    batch line) and adds its answer; 8 × ``batch_line_limit``, 176 MiB by default (2048
    vectors of 1024 floats written as JSON take about 45 MB)."""
    return 8 * batch_line_limit()


def read_part(handle: Any, name: str) -> Iterator[tuple[int, bytes]]:
    """A merge part's (number, line) pairs from the binary stream ``handle``, bounded as
    ``read_batch`` bounds a batch file (``part_line_limit``, NRVNA_MAX_BATCH_LINES lines): a
    part that is /dev/zero is refused once that much is read, naming ``name``."""
    try:
        yield from _bounded_lines(handle, part_line_limit(), "a part line's limit (8 batch lines: "
                                  "8 × (14 × NRVNA_MAX_PROMPT_BYTES + 8 MiB))", "a part holds")
    except InvalidInput as err:
        raise InvalidInput(f"{name}: {err}") from None
    except OSError as err:  # a folder, a device that fails: a usage error, not a conflict
        raise InvalidInput(f"cannot read {name}: {_os_error(err)}") from None


def _without_ids(calls: Any) -> Any:
    """Tool calls without their ``id``s (the job's ID is in each): a list of call objects, or
    result text of a call's JSON line each, as ``call_lines`` writes them."""
    import json

    if isinstance(calls, str):
        try:
            calls = [json.loads(line) for line in calls.splitlines()]
        except (ValueError, RecursionError):
            return calls  # text, not calls: compared as it is
    if not isinstance(calls, list):
        return calls
    return [{k: v for k, v in call.items() if k != "id"} if isinstance(call, dict) else call for call in calls]


def _answer_fields(holder: Any, text_key: str) -> Any:
    """A result, a choice or a message as compared: with tool calls, its text (their lines)
    and their ``id``s left out; anything else as it is."""
    if not isinstance(holder, dict) or not holder.get("tool_calls"):
        return holder
    fields = {k: v for k, v in holder.items() if k != text_key}
    fields["tool_calls"] = _without_ids(holder["tool_calls"])
    return fields


def _result_key(record: dict[str, Any]) -> str:
    """What a part's line says of its job's result, as fields: never what names or dates the
    job (its ID, the response's and each tool call's ``id``; its times and usage; a failure's
    message, which may name it: its code is compared). Two lines of one custom_id with the same
    key are the same result exported twice, from any workspace. The fields are compared as
    parsed: an ID is left out where it is an ID, never cut out of a text."""
    import json

    if "response" in record:  # an OpenAI Batch output line
        response = record.get("response")
        body = (response.get("body") if isinstance(response, dict) else None) or {}
        body = body if isinstance(body, dict) else {"body": body}
        choices = body.get("choices")
        if isinstance(choices, list):
            choices = [dict(choice, message=_answer_fields(choice.get("message"), "text"))
                       if isinstance(choice, dict) else choice for choice in choices]
        error = record.get("error")
        said: Any = [choices, body.get("data"), error.get("code") if isinstance(error, dict) else error]
    else:
        said = _answer_fields({k: record.get(k) for k in ("status", "result", "content", "tool_calls", "embeddings")},
                              "result")
        choices = record.get("choices")
        if isinstance(choices, list):
            choices = [_answer_fields(choice, "text") for choice in choices]
        meta = record.get("meta")
        code = meta.get("code") if isinstance(meta, dict) else None
        said = [said, choices, code if record.get("error") is not None else None]
    return json.dumps(said, sort_keys=True)


def merge_parts(order: list[str], parts: Iterable[tuple[str, Any]],
                requests: Optional[Mapping[str, tuple[int, str]]] = None,
                notes: Optional[list[str]] = None) -> tuple[list[bytes], list[str], list[str]]:
    """The parts' lines (exported JSONL or OpenAI lines of the shards) in the input's
    ``order`` of custom_ids, each once: (lines, the custom_ids no part has, one
    "custom_id (part line N, part line M)" for each two parts give different results). A part
    is (its name, its bytes or its (number, line) pairs, as ``read_part`` yields them). A line
    of the same result twice (a shard exported again) is taken once. InvalidInput, naming the
    part and line: a line that is no JSON object with a custom_id, one the input does not
    hold, and (``requests``: custom_id -> (the input's line, its request_digest)) one whose
    REQUEST_KEY says it answers another request. Lines without that key (exported before
    it) are taken, said once in ``notes``."""
    import json

    wanted = set(order)
    found: dict[str, tuple[bytes, str, str]] = {}
    conflicts: dict[str, str] = {}
    unchecked: dict[str, int] = {}
    for name, data in parts:
        numbered = enumerate(data.splitlines(), 1) if isinstance(data, (bytes, bytearray)) else data
        for number, line in numbered:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                raise InvalidInput(f"{name}: line {number}: not JSON") from None
            cid = record.get("custom_id") if isinstance(record, dict) else None
            if not isinstance(cid, str):
                raise InvalidInput(f"{name}: line {number}: no custom_id (an export of nrvna, jsonl or openai)")
            if "status" not in record and "response" not in record:
                raise InvalidInput(f"{name}: line {number}: not an export line (it has no status, as jsonl's, nor "
                                   "response, as openai's): a batch file's line?")
            if cid not in wanted:
                raise InvalidInput(f"{name}: line {number}: custom_id {cid!r} is not in the input")
            if requests is not None and cid in requests:
                if _answers_another(record, requests[cid][1], unchecked, name):
                    raise InvalidInput(f"{name}: line {number}: custom_id {cid!r} answers another request than "
                                       f"line {requests[cid][0]} of the input (its {REQUEST_KEY} differs): a part "
                                       "of another batch, or of another version of this file")
            key, where = _result_key(record), f"{name} line {number}"
            if cid in found and found[cid][1] != key and cid not in conflicts:
                conflicts[cid] = f"{cid} ({found[cid][2]}, {where})"
            found.setdefault(cid, (line.rstrip(b"\r\n") + b"\n", key, where))
    if unchecked and notes is not None:
        notes.append(f"{sum(unchecked.values())} lines of {', '.join(unchecked)} carry no {REQUEST_KEY} (exported "
                     "by an older nrvna): taken without checking that they answer the input's lines")
    lines = [found[cid][0] for cid in order if cid in found and cid not in conflicts]
    return lines, [cid for cid in order if cid not in found], list(conflicts.values())


def _answers_another(record: dict[str, Any], digest: str, unchecked: dict[str, int], name: str) -> bool:
    """Whether a part's line says it answers another request than ``digest``; a line that says
    nothing (an older export) is counted in ``unchecked`` under its part's ``name``."""
    given = record.get(REQUEST_KEY)
    if given is None:
        unchecked[name] = unchecked.get(name, 0) + 1
        return False
    return given != digest


# `export --format`: the choices, their help and the writers all come from here.
EXPORT_FORMATS: dict[str, ExportFormat] = {
    "jsonl": ExportFormat(_jsonl_record, _json_line(_jsonl_record),
                          'nrvna\'s record: {"id", "custom_id", "request_sha256", "status", "prompt", "result", "error", "meta"}'),
    "openai": ExportFormat(_openai_record, _json_line(_openai_record),
                           "an OpenAI Batch output line (a chat.completion or text_completion body), and request_sha256, "
                           "which OpenAI's readers ignore"),
    "text": ExportFormat(None, _text_line, "the results alone, each followed by a blank line (every choice of a job of n > 1)"),
    "f32": ExportFormat(None, _f32_rows, "embed jobs' vectors as one little-endian float32 matrix, a row per "
                        "text, every row one width (needs -o FILE; FILE.ids, or --ids IDS, says each row's job ID, "
                        "custom_id and input index, tab-separated; failed jobs go to --errors as jsonl)", _f32_ids),
}


class _ExportTarget:
    """Where an export's lines go (``-o FILE``, ``--errors FILE``), as a policy:

    - ``-`` is standard output;
    - an existing FIFO, character device (a terminal, /dev/null) or socket, and any path
      under /dev/ or /proc/ (``/dev/stdout`` may be a file the shell opened), is written
      through: opened for appending and written as it is, not atomically;
    - anything else is written whole or not at all: a temporary file of its own beside the
      real target (a symlink's target is replaced, never the link), fsynced, renamed over the
      target, the directory fsynced; the temporary file goes on every failure path;
    - an empty path, a directory and any path inside an nrvna workspace are refused: an
      export must never replace a job, the queue or the workspace lock.
    """

    def __init__(self, path: Any, binary: bool = False) -> None:
        path = os.fspath(path)
        self.temp: Optional[str] = None
        suffix, encoding = ("b", None) if binary else ("", "utf-8")
        if path == "-":
            self.handle, self.path, self.through = (sys.stdout.buffer if binary else sys.stdout), "-", True
            return
        if not path:
            raise InvalidInput("an output path is empty (use - for standard output)")
        self.path = os.path.realpath(path)
        workspace = _workspace_of(self.path)
        if workspace is not None:
            raise InvalidInput(f"{path} is inside the nrvna workspace {workspace}; write exports outside it")
        try:
            mode: Optional[int] = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise InvalidInput(f"{path} is a directory")
        self.through = _written_through(path)
        if self.through:
            self.handle = open(path, "a" + suffix, encoding=encoding)
            return
        folder, name = os.path.split(self.path)
        for _ in range(100):
            temp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
            try:  # 0666 less the umask, as any new file; an existing target keeps its mode
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o666)
                break
            except FileExistsError:
                continue
        else:
            raise WorkspaceError(f"cannot find a free temporary name beside {path}")
        self.temp = temp
        try:
            if mode is not None:
                os.fchmod(fd, stat.S_IMODE(mode))
            self.handle = open(fd, "w" + suffix, encoding=encoding, closefd=True)
        except BaseException:
            os.close(fd)
            _unlink_quietly(temp, None)
            raise

    def write(self, text: Any) -> None:
        """Append ``text`` (bytes for a binary output)."""
        try:
            self.handle.write(text)
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        if self.path == "-":
            raise BrokenPipeError  # `nrvna export ... | head`: main() exits quietly
        raise WorkspaceError(f"{self.path}: its reader went away (broken pipe); the export is incomplete") from None

    def commit(self) -> None:
        """Make the file whole (durable, under its final name) or flush the stream."""
        if self.temp is None:
            try:
                self.handle.flush()
                if self.path != "-":
                    self.handle.close()
            except BrokenPipeError:
                self._reader_gone()
            return
        self.handle.flush()
        try:
            os.fsync(self.handle.fileno())
            self.handle.close()
            os.rename(self.temp, self.path)
        except BaseException:
            self.abort()
            raise
        self.temp = None
        fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        """Drop the temporary file (the target is untouched); nothing after a commit."""
        if self.path != "-" and not self.handle.closed:
            try:
                self.handle.close()  # flushes what is buffered, which may fail again
            except OSError:
                pass
        if self.temp is not None:
            _unlink_quietly(self.temp, None)
            self.temp = None


##############################################################################
# 9. Client: Work submits, Flow reads and waits; cancel, retry, clean, stop
##############################################################################
# Owns Work, Flow and the commands on jobs. Invariant: a client changes a job only through
# section 7's renames and files, so a daemon's claim and a client's cancel or retry never both win.
# Runs in client processes; no daemon thread calls in.


# ============================================================================
# 9.1 Reading: Flow
# ============================================================================
# Flow reads, waits for and exports jobs, and bulk_states reads many jobs' states at once.
# Invariant: neither moves a job or writes in one. Runs in client processes.


def bulk_states(workspace: str, ids: Iterable[str]) -> dict[str, Status]:
    """The state of many jobs at once: one listing per state directory, not a lookup per job.

    Directories are listed in lifecycle order, so a job moving forward meanwhile is seen in
    its newer state; jobs seen nowhere (a requeue raced the listing) are looked up again."""
    wanted = set(ids)
    found: dict[str, Status] = {}
    for sub, status in STATE_DIRS:
        try:
            names = os.listdir(os.path.join(workspace, sub))
        except FileNotFoundError:
            continue
        for name in wanted.intersection(names):
            found[name] = status
    flow = Flow(workspace)
    for job_id in wanted - found.keys():
        found[job_id] = flow.status(job_id)
    return found


def _export_form(format: str, out: Any, ids_file: Any) -> tuple[ExportFormat, Any]:
    """``export``'s format, checked against its files, and the side file a binary format writes
    (by default ``out + ".ids"``)."""
    if format not in EXPORT_FORMATS:
        raise InvalidInput(f"unknown export format {format!r} (known: {', '.join(EXPORT_FORMATS)})")
    form = EXPORT_FORMATS[format]
    binary = form.side is not None
    if binary and not (isinstance(out, (str, os.PathLike)) and os.fspath(out) not in ("", "-")):
        raise InvalidInput(f"export --format {format} needs -o FILE (it writes FILE and FILE.ids)")
    if not binary and ids_file is not None:
        raise InvalidInput(f"--ids names the side file of a binary format; --format {format} has none")
    if binary and ids_file is None:
        if _written_through(os.fspath(out)):
            # /dev/null.ids, /dev/stdout.ids: a stray file beside a device, never what was meant
            raise InvalidInput(f"-o {os.fspath(out)} is not a regular file, so FILE.ids cannot go beside it: "
                               "name the rows' side file with --ids FILE")
        ids_file = os.fspath(out) + ".ids"
    return form, ids_file


def _refuse_same_files(out: Any, errors: Any, ids_file: Any) -> None:
    """InvalidInput when two of ``export``'s files (those given as paths) are one file."""
    named = [(what, os.fspath(t)) for what, t in (("the output", out), ("the errors file", errors),
                                                    ("the ids file", ids_file))
             if isinstance(t, (str, os.PathLike)) and os.fspath(t) != "-"]
    for i, (what, path) in enumerate(named):
        for earlier, other in named[:i]:
            if os.path.realpath(path) == os.path.realpath(other):
                raise InvalidInput(f"{earlier} and {what} are the same file ({other})")


class Flow:
    """Reads job states and results. Never blocks the daemon; safe to poll."""

    def __init__(self, workspace: Any) -> None:
        self.workspace = os.fspath(workspace)

    def status(self, job_id: str) -> Status:
        """The job's state; ``Missing`` for an unknown or invalid ID."""
        return self.locate(job_id)[0]

    def locate(self, job_id: str) -> tuple[Status, str]:
        """The job's state and directory (``Missing`` and "" if there is none)."""
        return locate_job(self.workspace, job_id)

    def get(self, job_id: str) -> Optional[Job]:
        """The job with its prompt, result or error and meta; None if there is none."""
        return self._retrying(job_id, lambda status, path: self._read(job_id, status, path))

    def _retrying(self, job_id: str, read: Callable[[Status, str], Any]) -> Any:
        """``read(status, path)`` of the job's directory, looked up again if the job moved
        on between the lookup and the read; None if there is no such job."""
        for _ in range(3):
            status, path = self.locate(job_id)
            if status is Status.Missing:
                return None
            try:
                return read(status, path)
            except FileNotFoundError:
                continue
        return None

    def _read(self, job_id: str, status: Status, path: str) -> Job:
        try:
            fd = open_dir(path)
        except OSError as err:
            if err.errno in (errno.ENOTDIR, errno.ELOOP):
                return Job(job_id, status, None, None, "not a job directory", {}, {})
            raise
        try:
            files = {}
            for name in (PROMPT_FILE, RESULT_FILE, ERROR_FILE, META_FILE, PARAMS_FILE, LOGPROBS_FILE, CHOICES_FILE,
                         REASONING_FILE, TOOL_CALLS_FILE):
                try:
                    files[name] = read_file(fd, name, 1 << 40).decode("utf-8", "replace")
                except (FileNotFoundError, JobError):
                    files[name] = None
            if status is Status.Done and files[RESULT_FILE] is None:
                raise FileNotFoundError(path)  # moved on between the lookup and the open
        finally:
            os.close(fd)
        meta = job_meta(files[META_FILE])
        error = files[ERROR_FILE]
        if status is Status.Failed and error is None:  # a cancel or retry was cut off midway
            history = meta.get("errors")
            if isinstance(history, list) and history and isinstance(history[-1], dict):
                error = f"{history[-1].get('error')}\n"
            elif os.path.lexists(os.path.join(path, CANCEL_FILE)):
                error, meta = "cancelled (nrvna cancel)\n", dict(meta, code="cancelled")
        logprobs = None
        if files[LOGPROBS_FILE] is not None:
            import json

            try:
                logprobs = json.loads(files[LOGPROBS_FILE])
            except (ValueError, RecursionError):
                logprobs = None  # a hand-made or damaged file: the job reads without it
            if not _logprobs_shape(logprobs):
                logprobs = None
        choices = _read_choices(files[CHOICES_FILE]) if status is Status.Done else None
        message = _read_message(files[TOOL_CALLS_FILE]) if status is Status.Done else None
        return Job(job_id, status, files[PROMPT_FILE], files[RESULT_FILE], error, meta, parse_meta(files[PARAMS_FILE]),
                   logprobs, choices, files[REASONING_FILE], message)

    def result_bytes(self, job_id: str, name: str = RESULT_FILE) -> Optional[bytes]:
        """result.txt of a done job, byte for byte (what ``nrvna get`` prints); ``name``
        REASONING_FILE: its thinking (``get --reasoning``), empty when it has none."""

        def read(status: Status, path: str) -> Optional[bytes]:
            if status is not Status.Done:
                return None
            fd = open_dir(path)
            try:
                return read_file(fd, name, 1 << 40)
            except FileNotFoundError:
                if name == RESULT_FILE:
                    raise
                return b""
            finally:
                os.close(fd)

        return self._retrying(job_id, read)

    def chain(self, job_id: str) -> list[Optional[str]]:
        """The jobs ``job_id`` continues, oldest first (``[root, ..., parent]``; ``[]`` for a
        job with no parent), walked through each one's ``parent``; an ancestor that is gone
        (cleaned) starts the list as None."""
        import json

        found: list[Optional[str]] = []
        seen = {job_id}
        current: Optional[str] = job_id
        while current is not None:
            status, path = locate_job(self.workspace, current)
            if status is Status.Missing:
                if current != job_id:
                    found[-1] = None
                break
            try:
                fd = open_dir(path)
                try:
                    params = json.loads(read_file(fd, PARAMS_FILE, params_limit()))
                finally:
                    os.close(fd)
            except (OSError, JobError, ValueError, RecursionError):
                params = {}
            parent = params.get("parent") if isinstance(params, dict) else None
            if not isinstance(parent, str) or parent in seen:  # (a hand-made cycle ends the walk)
                break
            seen.add(parent)
            found.append(parent)
            current = parent
        return found[::-1]

    def wait(self, job_id: str, timeout: Optional[float] = None,
             on_look: Optional[Callable[[Status], None]] = None) -> Status:
        """Block until the job is Done or Failed (or Missing, or ``timeout`` seconds pass).
        ``on_look(status)`` is called after every look that finds it unfinished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            status = self.status(job_id)
            if status.finished or status is Status.Missing:
                return status
            if on_look is not None:
                on_look(status)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return status
                delay = min(delay, left)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def counts(self) -> dict[str, int]:
        """How many jobs are in each state."""
        counts = {}
        for sub, status in STATE_DIRS:
            try:
                with os.scandir(os.path.join(self.workspace, sub)) as entries:
                    counts[status.value] = sum(1 for e in entries if not e.name.startswith("."))
            except FileNotFoundError:
                counts[status.value] = 0
        return counts

    def lanes(self) -> list[tuple[int, list[str]]]:
        """The queued jobs by priority, highest first, each lane in the order the daemon takes
        them (submission order): [(priority, [id, ...]), ...]."""
        ready = os.path.join(self.workspace, READY)
        try:
            with os.scandir(ready) as entries:
                names = [e.name for e in entries if not e.name.startswith(".")]
        except FileNotFoundError:
            return []
        lanes: dict[int, list[str]] = {}
        for name in names:
            lanes.setdefault(read_priority(os.path.join(ready, name)), []).append(name)
        return [(priority, sorted(lanes[priority], key=order_key)) for priority in sorted(lanes, reverse=True)]

    def select(self, ids: Iterable[str] = (), tag: Optional[str] = None) -> tuple[list[str], dict[str, Status]]:
        """The jobs named by ``ids`` and/or ``tag`` (neither: every job in the workspace), in
        order, without repeats, and their states. Raise NoSuchJob naming an unknown ID; a
        tag's jobs that no longer exist (cleaned) are left out."""
        require_workspace(self.workspace)
        named = list(ids)
        check_ids(named)
        wanted = list(named)
        if tag is not None:
            require_tag(self.workspace, tag)
            wanted += [job_id for job_id, _ in tag_members(self.workspace, tag)]
        elif not wanted:
            wanted = _all_jobs(self.workspace)
        states = bulk_states(self.workspace, wanted)
        missing = [job_id for job_id in named if states[job_id] is Status.Missing]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise NoSuchJob(f"no job {missing[0]} in {self.workspace}{more}")
        return [j for j in dict.fromkeys(wanted) if states[j] is not Status.Missing], states

    def wait_all(self, ids: Iterable[str] = (), tag: Optional[str] = None, timeout: Optional[float] = None,
                 on_progress: Optional[Callable[[dict[str, Status]], None]] = None) -> dict[str, Status]:
        """Wait until every selected job (see ``select``) is done or failed (or removed
        meanwhile: Missing), or ``timeout`` seconds pass; return their states then, in order. ``on_progress(states)`` is called
        after every look (one listing per state directory, however many jobs)."""
        selected, states = self.select(ids, tag)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.1
        while True:
            current = {job_id: states[job_id] for job_id in selected}
            if on_progress is not None:
                on_progress(current)
            if all(state.finished or state is Status.Missing for state in current.values()):
                return current  # Missing: removed meanwhile (clean); it will not finish
            if deadline is not None and time.monotonic() >= deadline:
                return current
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            began = time.monotonic()
            states = bulk_states(self.workspace, selected)
            delay = max(0.1, min(1.0, 3 * (time.monotonic() - began)))  # listing 100k jobs takes a while

    def follow(self, job_id: str, on_restart: Optional[Callable[[], None]] = None,
               on_look: Optional[Callable[[Status], None]] = None, result: bool = True) -> Iterator[bytes]:
        """The job's text as the daemon generates it (partial.txt, then result.txt), in
        pieces, until the job is done or failed; then read ``status``. What it yields is
        always a prefix of the final result, unless the daemon restarted the job: then
        ``on_restart()`` is called and the text is yielded again from its start.
        ``on_look(status)`` is called after every look that finds it unfinished. With
        ``result`` False it yields partial.txt only and ends when the job does (a caller that
        reads the finished job whole: a tool call's result.txt is its calls, not its text)."""
        printed, attempt, delay = 0, None, 0.02
        while True:
            status, path = self.locate(job_id)
            if status is Status.Missing:
                raise NoSuchJob(f"no job {job_id} in {self.workspace}")
            if status.finished and not result:
                return
            data = None
            if status is not Status.Queued:
                try:
                    fd = open_dir(path)
                except FileNotFoundError:
                    continue  # it moved on between the lookup and the open
                except NotADirectoryError:
                    return  # a hand-made entry, not a job: nothing will ever be generated
                try:
                    if status is Status.Running:
                        started = read_meta(fd).get("started")
                        if attempt is not None and started != attempt and printed:
                            if on_restart is not None:
                                on_restart()
                            printed = 0
                        attempt = started
                    data = _read_or_none(fd, RESULT_FILE if status is Status.Done else PARTIAL_FILE)
                finally:
                    os.close(fd)
            if status is Status.Done and data is None:
                time.sleep(delay)
                continue  # still being moved (or a hand-made job without result.txt): look again
            if data is not None and len(data) > printed:
                yield data[printed:]
                printed = len(data)
            if status.finished:
                return
            if on_look is not None:
                on_look(status)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def export(self, out: Any, ids: Iterable[str] = (), tag: Optional[str] = None, format: str = "jsonl",
               errors: Any = None, notes: Optional[list[str]] = None, ids_file: Any = None) -> tuple[int, int]:
        """Write one line per finished job, in submission order, in ``format`` (a key of
        EXPORT_FORMATS) to ``out``, and failed jobs' lines to ``errors`` if given. Each is a
        text stream or a path (``-`` is stdout; a file is written whole or not at all: see
        ``_ExportTarget`` for the policy). Return
        (lines written, unfinished jobs left out). Memory stays flat: one job at a time, and
        with a tag alone one chunk of its index.

        A binary format (``f32``) needs ``out`` to be a path: it writes the rows there and
        their side file to ``ids_file``, by default ``out + ".ids"`` (both whole or not at
        all), which needs ``out`` to be a regular file's path: beside a device, a FIFO or
        anything under /dev/ or /proc/, ``ids_file`` must be given. Every row has one width:
        jobs with vectors of another width are refused (a ragged matrix cannot be read back).
        Failed jobs, which have no rows, go to ``errors`` as jsonl lines, or are left out
        (counted in ``notes``)."""
        form, ids_file = _export_form(format, out, ids_file)
        selected = self._export_selection(ids, tag)
        _refuse_same_files(out, errors, ids_file)
        targets: list[Any] = []
        try:
            for target in (out, errors):
                targets.append(_ExportTarget(target, form.side is not None and not targets)
                               if isinstance(target, (str, os.PathLike)) else target)
            if form.side is not None:
                targets.append(_ExportTarget(ids_file) if isinstance(ids_file, (str, os.PathLike)) else ids_file)
            exported, unfinished, left_out, unreadable = self._export_jobs(selected, form, targets)
            for target in targets:
                if isinstance(target, _ExportTarget):
                    target.commit()
                elif target is not None:
                    target.flush()
        except BaseException:
            for target in targets:
                if isinstance(target, _ExportTarget):
                    try:
                        target.abort()
                    except OSError:
                        pass  # the next target's temporary file must go too
            raise
        if left_out and notes is not None:
            notes.append(f"{left_out} failed jobs have no vectors and were left out (--errors FILE lists them)")
        if unreadable:
            raise WorkspaceError(f"{len(unreadable)} jobs could not be read (permission denied: {unreadable[0]}"
                                 f"{', ...' if len(unreadable) > 1 else ''}); the other {exported} were exported")
        return exported, unfinished

    def _export_selection(self, ids: Iterable[str], tag: Optional[str]) -> Iterable[str]:
        """The jobs ``export`` goes through, in submission order (checked now, read lazily)."""
        ids = list(ids)
        if tag is not None and not ids:  # stream the tag's index: memory does not grow with the batch
            require_workspace(self.workspace)
            require_tag(self.workspace, tag)
            return (job_id for chunk in iter_tag_members(self.workspace, tag) for job_id, _ in chunk)
        return self.select(ids, tag)[0]

    def _export_jobs(self, selected: Iterable[str], form: ExportFormat,
                     targets: list[Any]) -> tuple[int, int, int, list[str]]:
        """Write each finished job of ``selected`` to its target (``targets``: the output, the
        errors or None, and a binary format's side file): (lines written, unfinished jobs,
        failed jobs a binary format left out for want of an errors target, unreadable jobs)."""
        binary = form.side is not None
        unfinished = exported = left_out = 0
        unreadable: list[str] = []
        first_row: Optional[tuple[int, str]] = None  # f32: (bytes a row, 4 a float; its job)
        for job_id in selected:
            try:
                job = self.get(job_id)
            except PermissionError:
                unreadable.append(job_id)
                continue
            if job is None:
                continue  # a tagged job removed since (clean)
            if not job.status.finished:
                unfinished += 1
                continue
            if binary and job.status is Status.Failed:
                if targets[1] is None:
                    left_out += 1
                else:
                    targets[1].write(EXPORT_FORMATS["jsonl"].line(job))
                continue
            target = targets[1] if targets[1] is not None and job.status is Status.Failed else targets[0]
            data = form.line(job)
            if binary:
                side = form.side(job)  # type: ignore[misc]
                width = len(data) // side.count("\n")  # one width within a job: _f32_rows saw to it
                if first_row is None:
                    first_row = (width, job.id)
                elif width != first_row[0]:
                    raise InvalidInput(f"job {job.id} has vectors of {width // 4} floats and job {first_row[1]} "
                                       f"of {first_row[0] // 4}: a matrix has one width (export them apart)")
                targets[2].write(side)
            target.write(data)
            exported += 1
        return exported, unfinished, left_out, unreadable


# ============================================================================
# 9.2 Submitting: Work
# ============================================================================
# Work and the checks a submit makes before it stages anything (model names, changed lines,
# keys). Invariant: a job is written whole in input/writing/, fsynced, then published by one rename;
# a key publishes once (_Keys).


class SubmitResult(namedtuple("SubmitResult", "ok id message")):
    """What ``Work.submit`` returns (``ok: bool, id: str, message: str``): errors are values
    here, never exceptions."""

    __slots__ = ()


def model_view(workspace: str) -> tuple[str, dict[str, str], list[str]]:
    """How model names are resolved for ``workspace``: (models dir, aliases, the model files
    its running daemons serve), as the oldest daemon's record says (every daemon resolves
    names its own way, but a workspace's daemons are started alike); with no daemon running,
    this process's NRVNA_MODELS_DIR and NRVNA_MODEL_ALIASES, and no model served."""
    records = daemon_records(workspace) if os.path.isdir(os.path.join(workspace, READY)) else []
    # a model's path; its name where it has none (a runner given in-process)
    served = [m["path"] if isinstance(m.get("path"), str) else m["name"] for r in records for m in r.get("models") or ()
              if isinstance(m, dict) and isinstance(m.get("path") or m.get("name"), str)]
    first = next((r for r in records if isinstance(r.get("models_dir"), str)), None)
    if first is not None:
        return first["models_dir"], dict(first.get("aliases") or {}), served
    return os.path.abspath(setting_default("models_dir")), parse_aliases(setting_default("model_aliases")), served


def check_model_names(workspace: str, named: Iterable[tuple[str, Optional[str]]], strict: bool) -> list[str]:
    """Check the model each job names (``(where, name)``; None: none) as the workspace resolves
    names (model_view): an ambiguous name is InvalidInput; a name that matches no model is
    InvalidInput when ``strict``, else a note (the job runs on a daemon's default model). Returns
    the notes."""
    by_name: dict[str, list[str]] = {}
    for where, name in named:
        if name is not None:
            by_name.setdefault(name, []).append(where)
    if not by_name:
        return []
    models_dir, aliases, served = model_view(workspace)
    # a served model's file name, with or without .gguf (as GET /v1/models lists it)
    served_names = {n for path in served for n in (os.path.basename(path),
                                                   re.sub(r"\.gguf$", "", os.path.basename(path)))}
    notes = []
    for name, places in by_name.items():
        matches = model_matches(name, models_dir, aliases)
        if len(matches) > 1:
            raise InvalidInput(f"{places[0]}: model name {name!r} is ambiguous in {models_dir}: "
                               f"{', '.join(os.path.basename(m) for m in matches)}")
        if matches:
            _check_model_file(places[0], name, matches[0])
            continue
        if name in served_names:
            continue
        if strict:
            known = sorted({*(gguf_files(models_dir) or []), *map(os.path.basename, served), *aliases})
            raise InvalidInput(f"{places[0]}: model {name!r} matches no model (known: {', '.join(known) or 'none'}; "
                               f"NRVNA_MODELS_DIR is {models_dir})")
        jobs = f"{len(places)} jobs run" if len(places) > 1 else "it runs"
        notes.append(f"model {name!r} matches no model in {models_dir}: {jobs} on a daemon's default model")
    return notes


def _check_model_file(where: str, name: str, path: str) -> None:
    """InvalidInput unless ``path``, the file model ``name`` resolves to, is a GGUF file: a job
    naming /dev/zero, a directory, a FIFO or /etc/passwd would wait forever for a daemon that
    can never serve it."""
    try:
        _check_gguf_magic(path)
    except ModelError as err:
        shown = "" if path == name else f" ({path})"
        raise InvalidInput(f"{where}: model {name!r}{shown} {str(err).removeprefix(f'model {path} ')}; a model "
                           "must be a regular file that starts with GGUF, or a name resolving to one") from None


def _absolute_model(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with a model named by a path made absolute: the daemon resolves it from
    another directory than the submitter's."""
    model = job_param(params, "model")
    if model is None or os.sep not in model or os.path.isabs(model):
        return params
    return dict(params, model=os.path.abspath(model))


def waiting_for_model(workspace: str, job_ids: Iterable[str]) -> dict[str, str]:
    """Why each queued job of ``job_ids`` waits although daemons run, by ID: it names a model
    no running daemon serves, or one that its daemon could not load (how many times, the
    error), or it names none and no running daemon serves its kind; or it continues a job
    (``parent``) that is queued or running. Jobs that are not waiting are left out; with no
    daemon running, every queued job waits for one."""
    routes = {job_id: read_route(job_path(workspace, READY, job_id)) for job_id in job_ids}
    records = daemon_records(workspace) if routes and os.path.isdir(os.path.join(workspace, READY)) else []
    if not records or any(r.get("starting") for r in records):
        return {}
    parents = {job_id: f"waits for its parent {route.parent} ({locate_job(workspace, route.parent)[0]})"
               for job_id, route in routes.items() if parent_unfinished(workspace, route.parent)}
    models_dir, aliases, served = model_view(workspace)
    healthy = {m["path"] for r in records for m in r.get("models") or ()
               if isinstance(m, dict) and isinstance(m.get("path"), str) and not m.get("load_failures")}
    failed = _failed_models(records)
    kinds = {k for r in records for k in (r["kinds"] if isinstance(r.get("kinds"), list) else
                                          [m.get("kind") for m in r.get("models") or () if isinstance(m, dict)])}
    serving = ", ".join(sorted({os.path.basename(path) for path in served}))
    reasons, verdicts = {}, {}
    for job_id, route in routes.items():
        key = (route.model, route.embed)
        if key not in verdicts:
            path = model_file(route.model, models_dir, aliases) if route.model is not None else None
            if path is None:  # names none (or no one model): the first model of its kind
                kind = "embed" if route.embed else "chat"
                verdicts[key] = None if kind in kinds else _kind_waits(kind, serving)
            elif path not in healthy:
                why = failed.get(path, f"which no running daemon serves (they serve {serving})")
                verdicts[key] = f"waits for model {route.model} ({os.path.basename(path)}), {why}"
            else:
                verdicts[key] = None
        if verdicts[key] is not None:
            reasons[job_id] = verdicts[key]
    return {**reasons, **parents}


def _failed_models(records: list[dict[str, Any]]) -> dict[str, str]:
    """The model files live daemons could not load (and no daemon serves), each with why."""
    failed = {}
    for record in records:
        for m in record.get("models") or ():
            if not isinstance(m, dict) or not isinstance(m.get("path"), str) or not m.get("load_failures"):
                continue
            retry = m.get("retry_at")
            then = (f"tried again in {max(0, retry - time.time()):.0f} s" if isinstance(retry, (int, float))
                    else "its jobs fail (load_failed) until the file changes")
            failed[m["path"]] = (f"which daemon {record.get('pid')} could not load ({m['load_failures']} of "
                                 f"{m.get('max_load_failures', '?')} failed loads: {m.get('load_error')}); {then}")
    return failed


def _kind_waits(kind: str, serving: str) -> str:
    if kind == "embed":
        return (f"waits for a daemon with an embedding model (or a chat model with NRVNA_POOLING=mean, cls or last): "
                f"the running daemons serve no embed jobs ({serving})")
    return f"waits for a daemon with a chat model: the running daemons serve embed jobs only ({serving})"


def _refuse_changed_lines(workspace: str, tag: str, entries: list[BatchEntry], ids: list[Optional[str]]) -> None:
    """Raise InvalidInput, before anything is queued, when a line's job (the job ``tag``
    already has for its custom_id, ``ids[i]``) holds another prompt than the line's: the
    file or its template changed. Running a submit again finishes an interrupted one; it
    never replaces a job, so queuing the other lines and printing the old jobs' IDs for the
    changed ones would hand back answers to prompts nobody asked now. (Flags may differ: a
    resume need not repeat them.)"""
    changed = [i for i, job_id in enumerate(ids)
               if job_id is not None and _prompt_differs(workspace, job_id, entries[i].prompt)]
    if not changed:
        return
    import shlex

    first, kept = changed[0], sum(1 for job_id in ids if job_id is not None)
    raise InvalidInput(
        f"{len(changed)} of {len(entries)} lines differ from the jobs tag {tag} already has for their custom_id "
        f"(line {entries[first].line}: job {ids[first]} has another prompt); nothing was queued and the {kept} "
        f"existing jobs were kept unchanged. To queue the new lines, submit them under a new --tag "
        f"('nrvna cancel {shlex.quote(workspace)} --tag {tag}' stops the old jobs)")


def _prompt_differs(workspace: str, job_id: str, prompt: bytes) -> bool:
    """Whether job ``job_id``'s prompt.txt is not ``prompt`` (an unreadable or hand-made job:
    not known to differ). Reads at most one byte more than ``prompt``."""
    for _ in range(3):  # it may move on between the lookup and the open
        status, path = locate_job(workspace, job_id)
        if status is Status.Missing:
            return False
        try:
            fd = open_dir(path)
        except FileNotFoundError:
            continue
        except OSError:
            return False
        try:
            return read_file(fd, PROMPT_FILE, len(prompt)) != prompt
        except FileNotFoundError:
            continue
        except JobError:  # longer than the line's prompt (or not a file): not this line's job
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    return False


class _Keys:
    """The idempotency keys of one publish (``Work.publish``, ``publish_batch``, ``submit_file``):
    the one place a key is looked up or taken. Taking a key links it to a staged job under a
    _KeyHolder made at the first key and released by ``close`` once the jobs are published or
    given up; a key this publish has taken answers with its job, never waited on as another's."""

    def __init__(self, workspace: str, notify: Optional[Callable[[str], None]]) -> None:
        self.workspace, self.notify = workspace, notify
        self.holder: Optional[_KeyHolder] = None
        self.taken: dict[str, str] = {}  # key -> the job this publish linked it to, or found under it

    def __enter__(self) -> _Keys:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.holder is not None:
            self.holder.close()  # published (or given up): its keys are no longer ours to publish

    def find(self, key: str) -> Optional[str]:
        """The job that has ``key`` already (one another client is publishing is waited for:
        see key_job), or None."""
        if key in self.taken:
            return self.taken[key]
        return key_job(self.workspace, key, notify=self.notify)

    def take(self, key: str, job_id: str) -> str:
        """Link ``key`` to the staged job ``job_id``, durably, and return ``job_id``; or return
        the job another client (or this publish, for an earlier job) has under ``key``: then
        ``job_id`` must not be published. The key is durable before its job is published: a
        job never runs without it."""
        if key in self.taken:
            return self.taken[key]
        if self.holder is None:
            self.holder = _KeyHolder(self.workspace)
        while not _link_key(self.workspace, key, job_id, self.holder.name):
            existing = key_job(self.workspace, key, notify=self.notify)
            if existing is not None:  # (else its key was stale and is gone: link again)
                job_id = existing
                break
        self.taken[key] = job_id
        return job_id


class _LineIds:
    """A batch file's IDs in file order as they become known: the lines published (``new``)
    get theirs chunk by chunk, a line repeating an earlier line's key (``same_as``) gets that
    line's, and ``on_ids`` hears each run of lines whose IDs are all known, in file order."""

    def __init__(self, ids: list[Optional[str]], new: list[int], same_as: dict[int, int],
                 on_ids: Optional[Callable[[list[str]], None]]) -> None:
        self.ids, self.new, self.same_as, self.on_ids = ids, new, same_as, on_ids
        self.known = self.placed = 0  # lines from the first whose IDs are known; new lines placed

    def add(self, chunk: list[str]) -> None:
        """Place the IDs of the next published lines, and hand on those now known in order."""
        ids = self.ids
        for job_id in chunk:
            ids[self.new[self.placed]] = job_id
            self.placed += 1
        for line, earlier in self.same_as.items():
            if ids[line] is None and ids[earlier] is not None:
                ids[line] = ids[earlier]
        start = self.known
        while self.known < len(ids) and ids[self.known] is not None:
            self.known += 1
        if self.on_ids is not None and self.known > start:
            self.on_ids(ids[start:self.known])  # type: ignore[arg-type]


def _batch_source(source: Any, jsonl: Optional[bool], template: Optional[str]) -> tuple[bytes, Optional[bool]]:
    """A batch file's bytes (``source``: a path, bytes or a binary stream), and whether it holds
    JSON lines as its name says (None: sniffed from the content)."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), jsonl
    if not isinstance(source, (str, os.PathLike)):
        return read_batch(source), jsonl  # stdin
    path = os.fspath(source)
    try:
        with open(path, "rb") as handle:
            data = read_batch(handle)
    except OSError as err:
        raise InvalidInput(f"cannot read {path}: {_os_error(err)}") from None
    if jsonl is None and (template is None or path.endswith((".csv", ".jsonl"))):
        jsonl = path.endswith(".jsonl")  # a template's data file of another name: sniffed
    return data, jsonl


def _parent_answer(path: str) -> tuple[Any, Optional[dict[str, Any]]]:
    """A parent's params.json ({} if unreadable) and its answer's calls (tool_calls.json, else None)."""
    try:
        fd = open_dir(path)
    except OSError:
        return {}, None
    texts: list[Optional[str]] = []
    try:
        for name in (PARAMS_FILE, TOOL_CALLS_FILE):
            try:
                texts.append(read_file(fd, name, params_limit()).decode("utf-8", "replace"))
            except (OSError, JobError):
                texts.append(None)
    finally:
        os.close(fd)
    return _json_or_none(texts[0], {}), _read_message(texts[1])


def _check_parents(workspace: str, named: list[tuple[str, Mapping[str, Any]]]) -> None:
    """Each (where, params) with a ``parent`` names a job of ``workspace``, in any state, that
    has turns to continue (not a raw or embed job), and tool turns first in its messages answer
    the calls of that job's answer once it is done (before, its claim checks them); without a
    parent there are none. Else InvalidInput prefixed by ``where`` ("line N: "). A parent exists
    before its child: no chain a submit makes is a cycle."""
    known: dict[str, tuple[Status, Any, Optional[dict[str, Any]]]] = {}  # a batch's lines may share a parent
    for where, params in named:
        parent = job_param(params, "parent")
        if parent is None:
            try:  # no parent: no calls for tool turns first to answer
                tool_answers(job_param(params, "messages") or [], ())
            except InvalidInput as err:
                raise InvalidInput(f"{where}{err}") from None
            continue
        if parent not in known:
            status, path = locate_job(workspace, parent)
            if status is Status.Missing:
                raise InvalidInput(f"{where}parent {parent} is no job in {workspace}")
            known[parent] = (status, *_parent_answer(path))
        status, its, message = known[parent]
        its = its if isinstance(its, dict) else {}
        if job_param(its, "raw") or job_param(its, "embed"):
            raise InvalidInput(f"{where}parent {parent} is {'a raw' if job_param(its, 'raw') else 'an embed'} job: "
                               "it has no turns to continue")
        if status is Status.Done:
            calls = [call["id"] for call in message["tool_calls"]] if message else []
            try:
                tool_answers(job_param(params, "messages") or [], calls, f"its parent {parent}'s answer")
            except InvalidInput as err:
                raise InvalidInput(f"{where}{err}") from None


class Work:
    """Submits jobs to a workspace. Create one per thread: it holds no lock and nothing other
    Work objects see, but ``existing`` says whether its own last publish found its key's job."""

    def __init__(self, workspace: Any, notify: Optional[Callable[[str], None]] = None,
                 strict_models: Optional[bool] = None) -> None:
        self.workspace = os.fspath(workspace)
        self.notify = notify  # hears that a submit waits for another one holding its key (the CLI: stderr)
        self.existing = False  # the last publish found its idempotency key's job: nothing was queued
        # A job naming a model that matches none: refused (InvalidInput), or queued with a note.
        self.strict_models = bool(setting_default("strict_models")) if strict_models is None else strict_models

    def submit(self, prompt: Any = None, **params: Any) -> SubmitResult:
        """Queue a prompt with optional per-job parameters; never raises. The message is
        ``queued``, or ``exists`` when a job with its ``idempotency_key`` was there already."""
        try:
            job_id, existed = self._publish(prompt, False, params)
            self.existing = existed  # as after publish
            return SubmitResult(True, job_id, "exists" if existed else "queued")
        except NotDurable as err:
            return SubmitResult(False, err.job_id, str(err))
        except NrvnaError as err:
            return SubmitResult(False, "", str(err))
        except OSError as err:
            return SubmitResult(False, "", f"cannot queue job: {_os_error(err)}")

    def publish(self, prompt: Any = None, *, dedupe: bool = False, **params: Any) -> str:
        """Queue a prompt and return its ID; raise NrvnaError/OSError on failure. With
        ``embed=True`` the prompt is a text to embed, or a list of them (a vector each); with
        ``messages`` and no prompt, prompt.txt shows the turns.
        With ``idempotency_key`` (or ``dedupe=True``: a key from the content), an existing job
        with that key is returned instead, and ``self.existing`` says so.

        Order (each step fsynced before the next): staging dir with prompt.txt and
        params.json -> rename into input/ready/ -> fsync input/ready/ and input/writing/.
        Only then is the ID returned: a returned ID is a durable job.
        """
        job_id, self.existing = self._publish(prompt, dedupe, params)
        return job_id

    def _publish(self, prompt: Any, dedupe: bool, params: dict[str, Any]) -> tuple[str, bool]:
        """``publish``'s job ID, and whether it is an existing job found by its key."""
        files, clean = self._job_files(prompt, dedupe, params)
        key = job_param(clean, "idempotency_key")
        with _Keys(self.workspace, self.notify) as keys:
            existing = None if key is None else keys.find(key)
            if existing is not None:
                return existing, True
            job_id, staging = self._stage(files)
            try:
                published = job_id if key is None else keys.take(key, job_id)
                if published == job_id:
                    if job_param(clean, "tag"):
                        _write_manifest(self.workspace, job_param(clean, "tag"), [(job_id, job_param(clean, "custom_id"))])
                    move(staging, os.path.join(self.workspace, READY, job_id))
            except BaseException:
                _remove_tree(staging)
                raise
            if published != job_id:
                _remove_tree(staging)  # another client's job has this key: return that one
                return published, True
        try:
            fsync_dir(os.path.join(self.workspace, READY))
            fsync_dir(os.path.join(self.workspace, WRITING))
        except OSError as err:
            raise NotDurable(job_id, err) from None
        return job_id, False

    def _job_files(self, prompt: Any, dedupe: bool, params: dict[str, Any]) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
        """A prompt's job checked whole: its files (prompt.txt, params.json) and parameters."""
        import json

        if "input" in params:
            raise InvalidInput("give the texts to embed as the prompt: publish([text, ...], embed=True)")
        if prompt is None and params.get("messages") is not None:  # the turns, as a batch line's prompt.txt
            prompt = render_messages(_check_messages(params["messages"], PARAMS["messages"]))
        if isinstance(prompt, (list, tuple)):  # texts to embed
            if not job_param(params, "embed"):
                raise InvalidInput("a list of texts is for embed jobs: give embed=True")
            prompt, params = _embed_input(check_inputs(list(prompt), PARAMS["input"].high), dict(params))
        data = check_prompt(prompt, setting_default("max_prompt_bytes"))
        clean = validate_params(params)
        for note in check_model_names(self.workspace, [("the job", job_param(clean, "model"))], self.strict_models):
            if self.notify is not None:
                self.notify(note)
        clean = _absolute_model(clean)
        _check_parents(self.workspace, [("", clean)])
        if dedupe and "idempotency_key" not in clean:
            clean["idempotency_key"] = dedupe_key(data, clean)
        ensure_workspace(self.workspace)
        files = [(PROMPT_FILE, data)]
        if clean:
            files.append((PARAMS_FILE, json.dumps(clean, ensure_ascii=False).encode()))
        return files, clean

    def publish_batch(self, entries: list[BatchEntry], tag: Optional[str] = None,
                      on_chunk: Optional[Callable[[list[str]], None]] = None) -> list[str]:
        """Queue many prompts; return their IDs in order. Raise NrvnaError/OSError.

        Chunks of BATCH_CHUNK jobs are staged in input/writing/ without per-file fsyncs,
        flushed with one syncfs, recorded in the tag index, renamed into input/ready/ one
        by one, and the two directories fsynced: the same guarantee as ``publish`` (a job in
        ready/ is complete and durable; an ID handed to ``on_chunk`` is a durable job) for
        a few flushes per chunk instead of four per job. A crash leaves whole jobs in ready/
        and staged ones in writing/ (removed by the daemon later, never run).
        """
        with _Keys(self.workspace, self.notify) as keys:
            return self._publish_batch(entries, tag, on_chunk, keys)[0]

    def _publish_batch(self, entries: list[BatchEntry], tag: Optional[str],
                       on_chunk: Optional[Callable[[list[str]], None]], keys: _Keys) -> tuple[list[str], int]:
        """``publish_batch``'s IDs, and how many lines found their key's job (nothing queued for them)."""
        ensure_workspace(self.workspace)
        ids: list[str] = []
        found = 0
        for first in range(0, len(entries), BATCH_CHUNK):
            chunk, chunk_found = self._publish_chunk(entries[first:first + BATCH_CHUNK], tag, keys)
            ids += chunk
            found += chunk_found
            fsync_dir(os.path.join(self.workspace, READY))
            fsync_dir(os.path.join(self.workspace, WRITING))
            if on_chunk is not None:
                on_chunk(chunk)
        return ids, found

    def _publish_chunk(self, chunk: list[BatchEntry], tag: Optional[str], keys: _Keys) -> tuple[list[str], int]:
        """Stage, flush and publish one chunk: its IDs, and how many of its lines found their key's job."""
        import json

        staged: list[tuple[str, str]] = []
        published: list[str] = []
        try:
            for entry in chunk:
                params = dict(entry.params, tag=tag) if tag else entry.params
                staged.append(self._stage([(PROMPT_FILE, entry.prompt),
                                           (PARAMS_FILE, json.dumps(params, ensure_ascii=False).encode())],
                                          sync=False))
            _syncfs(self.workspace)
            # Lines with an idempotency key: the key first (as in publish); a line whose key
            # another client holds is not published, and answers with that client's job.
            final = [job_id if key is None else keys.take(key, job_id)
                     for (job_id, _), key in zip(staged, (job_param(e.params, "idempotency_key") for e in chunk))]
            if tag:
                _write_manifest(self.workspace, tag, [(job_id, job_param(e.params, "custom_id"))
                                                      for job_id, e in zip(final, chunk)])
            for (job_id, staging), answer in zip(staged, final):
                if answer == job_id:
                    move(staging, os.path.join(self.workspace, READY, job_id))
                else:
                    _remove_tree(staging)
                published.append(answer)
        finally:
            for _, staging in staged[len(published):]:  # not published: never leave them to look like jobs
                _remove_tree(staging)
        return published, sum(answer != job_id for (job_id, _), answer in zip(staged, published))

    def submit_file(self, source: Any, *, tag: Optional[str] = None, jsonl: Optional[bool] = None,
                    on_ids: Optional[Callable[[list[str]], None]] = None, notes: Optional[list[str]] = None,
                    dedupe: bool = False, template: Optional[str] = None, id_field: Optional[str] = None,
                    shard: Optional[tuple[int, int]] = None, **defaults: Any) -> list[str]:
        """Queue every line of a batch file; return every line's ID, in file order.

        ``source`` is a path (``*.jsonl`` holds JSON lines, any other file one prompt per
        line), the file's bytes or a binary stream (JSON lines when ``jsonl`` is None and every
        line is an object); a path or a stream is read with ``read_batch`` (a line over
        ``batch_line_limit`` is refused). ``defaults`` are job parameters for every line (a
        line's own win). The whole file is checked first (InvalidInput naming the line; nothing queued). With ``tag``,
        lines whose ``custom_id`` is already queued under that tag are not queued again: an
        interrupted submit is finished by running it again; a line whose job there holds another
        prompt (the file or template changed) is InvalidInput, nothing queued. ``on_ids(ids)`` gets the IDs in
        file order as soon as each is known and durable; ``notes`` collects remarks for the
        user (a model name that matches no model, lines already queued). A line with an
        ``idempotency_key`` (or every line, with ``dedupe``: a key from its content) whose key
        names an existing job is not queued: its ID is that job's.

        With ``template``, the file holds data instead (see ``parse_records``: JSONL objects, or
        CSV under a header row, as ``*.csv`` or a first line that is not an object says): each
        record fills the template and is kept as the job's ``metadata``; ``id_field`` names
        the field that gives ``custom_id``.

        With ``shard`` (I, N), only the lines of shard I of N are queued (``shard_of`` each
        line's ``custom_id``), after the whole file is checked: N nodes given the same file and
        their own I queue each line once between them; the IDs returned are the shard's.
        """
        if id_field is not None and template is None:
            raise InvalidInput("--id-field names a field of a template's records: give --template too")
        data, jsonl = _batch_source(source, jsonl, template)
        notes = [] if notes is None else notes
        if template is not None:
            entries = parse_records(data, template, id_field, None if jsonl is None else not jsonl)
        else:
            entries = parse_batch(data, jsonl, notes)
        entries = self._with_defaults(entries, tag, dedupe, notes, defaults)
        if tag is not None:
            claim_tag_shard(self.workspace, tag, shard)
        if shard is not None:
            total = len(entries)
            entries = [e for e in entries if shard_of(e.params["custom_id"], shard[1]) == shard[0]]
            notes.append(f"shard {shard[0]}/{shard[1]}: {len(entries)} of {total} lines")
            if not entries and tag is not None and not _tag_known(self.workspace, tag):
                # The tag exists even so: this node's wait and export then end at once, empty.
                ensure_workspace(self.workspace)
                _write_manifest(self.workspace, tag, [])
        with _Keys(self.workspace, self.notify) as keys:
            ids, new, same_as, keyed = self._plan_lines(entries, tag, notes, keys)
            lines = _LineIds(ids, new, same_as, on_ids)
            lines.add([])
            keyed += self._publish_batch([entries[i] for i in new], tag, lines.add, keys)[1]
        if keyed:
            notes.append(f"{keyed} of {len(entries)} lines matched an existing job by idempotency key; "
                         "their IDs are those jobs' (nothing queued for them)")
        return ids  # type: ignore[return-value]

    def _with_defaults(self, entries: list[BatchEntry], tag: Optional[str], dedupe: bool, notes: list[str],
                       defaults: dict[str, Any]) -> list[BatchEntry]:
        """A batch file's lines with the flags' parameters (``defaults``) under their own,
        checked together, each model named as a path, and (``dedupe``) a key from each line's
        content; a note in ``notes`` for a model name that matches no model."""
        defaults = validate_params(defaults)
        if tag is not None:
            validate_params({"tag": tag})
        # The flags' generation parameters are defaults for the file's generation lines only.
        embed_defaults = {k: v for k, v in defaults.items() if k in EMBED_PARAMS}
        entries = [BatchEntry(e.line, e.prompt, {**(embed_defaults if job_param(e.params, "embed") else defaults), **e.params})
                   for e in entries]
        if "idempotency_key" in defaults:
            raise InvalidInput("--idempotency-key names one job: give each line its own idempotency_key, "
                               "or use --dedupe")
        if defaults:  # a line's own parameters were checked alone: check them with the defaults
            for entry in entries:
                try:
                    check_combination(entry.params)
                except InvalidInput as err:
                    raise InvalidInput(f"line {entry.line}: {err} (with the flags given for every line)") from None
        notes.extend(check_model_names(self.workspace, [(f"line {e.line}", job_param(e.params, "model"))
                                                        for e in entries], self.strict_models))
        entries = [BatchEntry(e.line, e.prompt, _absolute_model(e.params)) for e in entries]
        _check_parents(self.workspace, [(f"line {e.line}: ", e.params) for e in entries])
        if dedupe:
            entries = [e if "idempotency_key" in e.params else
                       BatchEntry(e.line, e.prompt, dict(e.params, idempotency_key=dedupe_key(e.prompt, e.params)))
                       for e in entries]
        return entries

    def _plan_lines(self, entries: list[BatchEntry], tag: Optional[str], notes: list[str],
                    keys: _Keys) -> tuple[list[Optional[str]], list[int], dict[int, int], int]:
        """Which lines of a batch file have a job already: (each line's ID, None for those to
        queue; the lines to queue; a line whose key an earlier line has -> that line; how many
        lines found their key's job). Those with ``tag`` queued under their ``custom_id`` (a
        resumed submit) are told in ``notes``."""
        existing: dict[str, str] = {}
        if tag:
            members = tag_members(self.workspace, tag)
            states = bulk_states(self.workspace, [job_id for job_id, _ in members])
            existing = {cid: job_id for job_id, cid in members if cid is not None and states[job_id] is not Status.Missing}
        ids: list[Optional[str]] = [existing.get(job_param(e.params, "custom_id")) for e in entries]
        if existing:
            _refuse_changed_lines(self.workspace, tag, entries, ids)  # type: ignore[arg-type]
        keyed = 0
        first_with: dict[str, int] = {}
        same_as: dict[int, int] = {}
        for i, entry in enumerate(entries):
            key = job_param(entry.params, "idempotency_key")
            if ids[i] is None and key is not None and os.path.isdir(self.workspace):
                ids[i] = keys.find(key)
                keyed += ids[i] is not None
        for i, entry in enumerate(entries):
            key = job_param(entry.params, "idempotency_key")
            if ids[i] is None and key is not None:
                if key in first_with:
                    same_as[i] = first_with[key]
                else:
                    first_with[key] = i
        new = [i for i, job_id in enumerate(ids) if job_id is None and i not in same_as]
        if same_as:
            notes.append("1 line repeats an earlier line's idempotency key: it gets its job" if len(same_as) == 1 else
                         f"{len(same_as)} lines repeat an earlier line's idempotency key: they get its job")
        if existing:
            notes.append(f"{len(entries) - len(new) - len(same_as) - keyed} of {len(entries)} lines are already queued with tag "
                         f"{tag}; queuing the other {len(new)}")
        return ids, new, same_as, keyed

    def _stage(self, files: list[tuple[str, bytes]], sync: bool = True) -> tuple[str, str]:
        """Create input/writing/<new id>/ exclusively and write the job's files into it
        (fsynced unless ``sync`` is False: the caller flushes the filesystem itself)."""
        writing = os.path.join(self.workspace, WRITING)
        for _ in range(1000):
            job_id = generate_id()
            staging = os.path.join(writing, job_id)
            try:
                os.mkdir(staging, DIR_MODE)
            except FileExistsError:
                continue
            # The same pid in the same second after a reboot or pid reuse: never reuse an ID.
            if any(os.path.lexists(os.path.join(self.workspace, sub, job_id)) for sub, _ in STATE_DIRS):
                os.rmdir(staging)
                continue
            break
        else:
            raise WorkspaceError("cannot find a free job ID")
        try:
            fd = open_dir(staging)
            try:
                for name, data in files:
                    if sync:
                        write_file(fd, name, data)
                    else:  # a private staging dir, flushed whole by the caller: no temp name needed
                        _write_new(fd, name, data)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _remove_tree(staging)
            raise
        return job_id, staging


# ============================================================================
# 9.3 Events
# ============================================================================
# iter_events: jobs' changes of state from meta.json's events, in order, followed live by
# watching the state directories (section 7's job_history reconciles each job).


def format_time(when: float) -> str:
    """ISO 8601 in UTC with milliseconds: ``2026-11-24T12:01:30.123Z``."""
    millis = int(round(when * 1000))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}Z"


def _job_events(workspace: str, job_id: str, sub: Optional[str]) -> Optional[tuple[list[list[Any]], dict[str, Any]]]:
    """(history, params) of a job, read where ``sub`` says (else wherever it is), or None if
    it is nowhere. The directory is checked again after meta.json is read: a history read as
    the job moved on is read again, so it is always reconciled with a place the job was in
    after the read."""
    for _ in range(20):
        if sub is None:
            status, path = locate_job(workspace, job_id)
            if status is Status.Missing:
                return None
            sub = STATUS_DIR[status]
        path = job_path(workspace, sub, job_id)
        try:
            fd = open_dir(path)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            sub = None
            continue
        try:
            meta, params = read_meta_and_params(fd)
            submitted = meta.get("submitted") or submitted_time(job_id, fd)
            info = os.fstat(fd)
            try:
                still = os.lstat(path).st_ino == info.st_ino
            except FileNotFoundError:
                still = False
        finally:
            os.close(fd)
        if not still:
            sub = None
            continue
        return job_history(meta, SUB_STATUS[sub], submitted, info.st_ctime), params
    return None


def iter_events(workspace: str, since: Optional[float] = None, tag: Optional[str] = None, follow: bool = False,
                alive: Callable[[], bool] = lambda: True) -> Iterator[list[dict[str, Any]]]:
    """Jobs' changes of state, in time order, a list at a time: ``{time, id, custom_id, tag,
    from, to, code}`` (see job_history). First every change known (at or after ``since``, an
    epoch time; of ``tag``'s jobs only), then, with ``follow``, each new one as it happens
    (inotify on the state directories, else a listing every 0.5 s) while ``alive()``."""
    emitted: dict[str, int] = {}  # changes of each job seen so far (reported or before since)

    def changes(job_id: str, sub: Optional[str]) -> list[tuple[Any, ...]]:
        """The job's changes not reported yet, as compact tuples (a replay holds them all to sort them)."""
        read = _job_events(workspace, job_id, sub)
        if read is None:
            return []
        history, params = read
        if tag is not None and job_param(params, "tag") != tag:
            return []
        out, first = [], emitted.get(job_id, 0)
        emitted[job_id] = max(first, len(history))
        order, cid, job_tag = order_key(job_id), job_param(params, "custom_id"), job_param(params, "tag")
        for i in range(first, len(history)):
            when, to = history[i][0], history[i][1]
            if since is not None and when < since:
                continue
            out.append((when, order, i, job_id, cid, job_tag, EVENT_STATUS[history[i - 1][1]].value if i else None,
                        to, history[i][2] if len(history[i]) > 2 else None))
        return out

    def as_events(found: list[tuple[Any, ...]]) -> Iterator[list[dict[str, Any]]]:
        found.sort(key=lambda change: change[:3])
        for first in range(0, len(found), 10_000):
            yield [{"time": format_time(when), "id": job_id, "custom_id": cid, "tag": job_tag, "from": from_,
                    "to": to, "code": code}
                   for when, _, _, job_id, cid, job_tag, from_, to, code in found[first:first + 10_000]]

    watches = _watch_states(workspace) if follow else None
    listed = {sub: _folder_entries(workspace, sub) for sub, _ in STATE_DIRS}
    mtimes = {sub: _mtime(workspace, sub) for sub in listed}
    if tag is not None:
        members = {job_id for job_id, _ in tag_members(workspace, tag)}
        jobs = [(job_id, sub) for sub, names in listed.items() for job_id in names & members]
    else:
        jobs = [(job_id, sub) for sub, names in listed.items() for job_id in names]
    found = [change for job_id, sub in jobs for change in changes(job_id, sub)]
    del jobs
    yield from as_events(found)
    del found
    while follow and alive():
        names: set[str] = set()
        if watches is not None:
            import select

            ready, _, _ = select.select(watches, [], [], 0.5)
            for watch in ready:
                events, overflow = watch.read()
                names.update(name for _, name in events)
                if overflow:  # the kernel dropped some: look at everything
                    names.update(n for sub in listed for n in _folder_entries(workspace, sub))
        else:
            time.sleep(0.5)
            for sub in listed:
                mtime = _mtime(workspace, sub)
                # A change in the same clock tick as the last listing keeps the mtime: while it
                # is recent, list again.
                if mtime != mtimes[sub] or time.time() - mtime / 1e9 < 1.0:
                    mtimes[sub], current = mtime, _folder_entries(workspace, sub)
                    names.update(current - listed[sub])
                    listed[sub] = current
        found = [change for job_id in names if is_valid_id(job_id) for change in changes(job_id, None)]
        yield from as_events(found)
    for watch in watches or ():
        watch.close()


def _mtime(workspace: str, sub: str) -> int:
    try:
        return os.stat(job_path(workspace, sub)).st_mtime_ns
    except FileNotFoundError:
        return 0


def _watch_states(workspace: str) -> Optional[list[Any]]:
    """inotify watches on the four state directories, or None where there is no inotify."""
    if not sys.platform.startswith("linux"):
        return None
    watches: list[Any] = []
    try:
        for sub, _ in STATE_DIRS:
            watches.append(_DirWatch(job_path(workspace, sub)))
    except OSError:
        for watch in watches:
            watch.close()
        return None
    return watches


# ============================================================================
# 9.4 Cancel, retry, clean
# ============================================================================
# The commands that change queued or ended jobs. Invariant: each acts by a rename that loses to
# a daemon's claim cleanly; a running job is cancelled by its cancel file, which the Watcher reads.


def cancel_job(workspace: str, job_id: str, timeout: float = 10.0) -> tuple[str, str]:
    """Cancel a job; return ``(outcome, message)`` with outcome ``cancelled`` (it is in
    failed/ with code cancelled), ``finished`` (it was done or failed already: left alone)
    or ``pending`` (the daemon has not stopped it within ``timeout`` s), or ``refused`` (its
    directory is not accessible). Raise NoSuchJob.

    A queued job is taken with a rename (a claim racing it loses or wins cleanly); a
    running job gets a ``cancel`` file that the daemon sees within 100 ms and stops it
    between tokens. Either way a ``cancel`` file goes in first, so whoever ends up holding
    the job knows: a claim that wins the race fails the job as cancelled at once.
    """
    flow = Flow(workspace)
    deadline = time.monotonic() + timeout
    marker = f"cancelled by nrvna cancel at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode()
    while True:
        status, path = flow.locate(job_id)
        if status is Status.Missing:
            raise NoSuchJob(f"no job {job_id} in {workspace}")
        if status.finished:
            job = flow.get(job_id)
            code = job.meta.get("code") if job else None
            if status is Status.Failed and code == "cancelled":
                return "cancelled", f"job {job_id} was cancelled"
            return "finished", f"job {job_id} is {status.value} already; left alone"
        try:
            fd = open_dir(path)
        except FileNotFoundError:
            continue  # it moved on: look again
        except NotADirectoryError:
            return "refused", f"job {job_id} is not a job directory"
        except PermissionError as err:
            return "refused", f"job {job_id} cannot be cancelled: its directory is not accessible ({_os_error(err)})"
        try:
            write_file(fd, CANCEL_FILE, marker)
            os.fsync(fd)
        except FileNotFoundError:
            continue
        except OSError as err:  # a read-only or full workspace: say which job it left alone
            return "refused", f"job {job_id} cannot be cancelled: its {CANCEL_FILE} file cannot be written ({_os_error(err)})"
        finally:
            os.close(fd)
        if status is Status.Queued:
            owe_hooks(workspace, job_id)
            try:
                move(path, os.path.join(workspace, FAILED, job_id))
            except FileNotFoundError:
                continue  # a worker claimed it first: it sees the cancel file
            mark_failed(workspace, FAILED, job_id, "cancelled", "cancelled before it started (nrvna cancel)",
                        came_from=Status.Queued)
            fsync_dir(os.path.join(workspace, FAILED))
            fsync_dir(os.path.join(workspace, READY))
            return "cancelled", f"job {job_id} cancelled"
        # Running: the daemon stops it; wait to see how it ended.
        while flow.status(job_id) is Status.Running and time.monotonic() < deadline:
            if _cancel_orphan(workspace, job_id):  # no daemon holds it: nobody else will
                break
            time.sleep(0.02)
        if flow.status(job_id) is Status.Running:
            return "pending", f"job {job_id}: cancel requested; the daemon has not stopped it yet"


def _cancel_orphan(workspace: str, job_id: str) -> bool:
    """The job is in processing/ and no live daemon holds it (its daemon died): fail it here,
    holding it and the WorkspaceLock so that no daemon recovers it meanwhile."""
    with WorkspaceLock(workspace):
        fd = hold_orphan(workspace, job_id)
        if fd is None:
            return False
        try:
            mark_failed(workspace, PROCESSING, job_id, "cancelled", "cancelled while no daemon ran it (nrvna cancel)")
            owe_hooks(workspace, job_id)
            move(os.path.join(workspace, PROCESSING, job_id), os.path.join(workspace, FAILED, job_id))
            fsync_dir(os.path.join(workspace, FAILED))
            fsync_dir(os.path.join(workspace, PROCESSING))
            return True
        finally:
            os.close(fd)


def cancel_jobs(workspace: str, ids: Iterable[str] = (), tag: Optional[str] = None,
                timeout: float = 10.0) -> list[tuple[str, str, str]]:
    """``cancel_job`` for every job named by ``ids`` and/or ``tag`` (at least one); return
    ``(id, outcome, message)`` for each. A tag's jobs that had finished already are left
    alone unopened (outcome ``finished``)."""
    ids = list(ids)
    if not ids and tag is None:
        raise InvalidInput("name jobs: IDs or --tag")
    selected, states = Flow(workspace).select(ids, tag)
    named, results = set(ids), []
    for job_id in selected:
        if job_id not in named and states[job_id].finished:
            results.append((job_id, "finished", f"job {job_id} is {states[job_id].value} already; left alone"))
            continue
        try:
            results.append((job_id, *cancel_job(workspace, job_id, timeout)))
        except NoSuchJob:  # removed meanwhile (clean): the rest of the selection goes on
            results.append((job_id, "missing", f"job {job_id} is gone (removed meanwhile)"))
    return results


def retry_job(workspace: str, job_id: str, codes: Optional[Iterable[str]] = None) -> tuple[str, str]:
    """Send a failed job back to the queue with its attempts reset and its earlier errors
    kept in meta.json (``errors``). Return ``(outcome, message)``: ``queued``, ``skipped``
    (its code is not in ``codes``) or ``refused`` (it is not failed). Raise NoSuchJob.

    Order: meta.json (with the error history) is rewritten first, then error.txt and the
    other leftovers go, then the rename: a crash between leaves a failed job whose error
    is still readable from meta.json, never a job in two places."""
    flow = Flow(workspace)
    status, path = flow.locate(job_id)
    if status is Status.Missing:
        raise NoSuchJob(f"no job {job_id} in {workspace}")
    if status is not Status.Failed:
        return "refused", f"job {job_id} is {status.value}; only failed jobs are retried"
    job = flow.get(job_id)
    if job is None:
        raise NoSuchJob(f"no job {job_id} in {workspace}")
    code = job.meta.get("code")
    if codes is not None and code not in set(codes):
        return "skipped", f"job {job_id} failed with {code}"
    gone = f"job {job_id} moved or was removed meanwhile (another retry, or a clean)"
    try:
        fd = open_dir(path)
    except NotADirectoryError:
        return "refused", f"job {job_id} is not a job directory"
    except FileNotFoundError:
        raise NoSuchJob(gone) from None
    try:
        if _exists(fd, QUARANTINED_ENTRY):
            return "refused", f"job {job_id} is a quarantined entry, not a job; it cannot run"
        meta = dict(job.meta)
        history = list(meta.get("errors") or [])
        if job.error is not None or code:
            history.append({"code": code, "error": (job.error or "").rstrip("\n"),
                            "finished": meta.get("finished"), "attempts": meta.get("attempts")})
        kept = {k: meta[k] for k in ("id", "submitted", "events") if k in meta}
        record_event(kept, Status.Failed, "requeued", "retried")
        write_file(fd, META_FILE, dump_meta(dict(kept, attempts=0, errors=history, retries=len(history))))
        for name in (ERROR_FILE, PARTIAL_FILE, CANCEL_FILE, RESULT_FILE, LOGPROBS_FILE, CHOICES_FILE, REASONING_FILE,
                     CONVERSATION_FILE, TOOL_CALLS_FILE):
            _unlink_quietly(name, fd)
        os.fsync(fd)
    except FileNotFoundError:  # a clean renamed the directory away and is deleting it
        raise NoSuchJob(gone) from None
    finally:
        os.close(fd)
    try:
        move(path, os.path.join(workspace, READY, job_id))
    except FileNotFoundError:
        raise NoSuchJob(gone) from None
    fsync_dir(os.path.join(workspace, READY))
    fsync_dir(os.path.join(workspace, FAILED))
    return "queued", f"job {job_id} queued again"


def retry_jobs(workspace: str, ids: Iterable[str] = (), tag: Optional[str] = None, failed: bool = False,
               codes: Optional[Iterable[str]] = None) -> list[tuple[str, str, str]]:
    """``retry_job`` for every job named by ``ids`` and/or ``tag``, or every failed job
    (``failed``); return ``(id, outcome, message)`` for each. ``codes`` (keys of
    FAILURE_CODES) limits it to jobs that failed with one of them; an unknown one is refused,
    not matched by nothing (`--code tmeout` would queue nothing and say so only by its silence)."""
    ids = list(ids)
    codes = None if codes is None else list(codes)
    if codes is not None and not codes:  # `--code ""`: a script's empty variable, not "every code"
        raise InvalidInput(f"no failure code given (known: {', '.join(FAILURE_CODES)})")
    for code in codes or ():
        if code not in FAILURE_CODES:
            raise InvalidInput(f"unknown failure code {code!r} (known: {', '.join(FAILURE_CODES)})")
    if failed:
        require_workspace(workspace)
        selected = sorted((n for n in os.listdir(job_path(workspace, FAILED)) if not n.startswith(".")), key=order_key)
    elif ids or tag is not None:
        selected = Flow(workspace).select(ids, tag)[0]
    else:
        raise InvalidInput("name jobs: IDs, --tag or --failed")
    results = []
    for job_id in selected:
        try:
            results.append((job_id, *retry_job(workspace, job_id, codes)))
        except NoSuchJob:  # removed meanwhile (clean): the rest of the selection goes on
            results.append((job_id, "missing", f"job {job_id} is gone (removed meanwhile)"))
    return results


def clean_jobs(workspace: str, older_than: float, done: bool = True, failed: bool = True,
               dry_run: bool = False, now: Optional[float] = None, notes: Optional[list[str]] = None) -> list[str]:
    """Remove finished jobs that finished more than ``older_than`` seconds ago; return their
    IDs. Queued and running jobs are never touched. Each job is first renamed to a hidden
    name (atomic: readers see it whole or not at all), then deleted; so are the KV states
    saved from their contexts (NRVNA_CACHE_DIR, else the workspace's states/). A tag index
    that is not nrvna's is left as it is, with a line in ``notes`` saying so."""
    require_workspace(workspace)
    now = time.time() if now is None else now
    removed = []
    for sub, wanted in ((OUTPUT, done), (FAILED, failed)):
        if not wanted:
            continue
        folder = os.path.join(workspace, sub)
        with os.scandir(folder) as entries:
            names = sorted((e.name for e in entries), key=order_key)
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith(".trash-") and not dry_run:
                _remove_tree(path)  # an earlier clean died halfway
                continue
            if name.startswith("."):
                continue
            if now - _finished_at(path) < older_than:
                continue
            removed.append(name)
            if dry_run:
                continue
            trash = os.path.join(folder, f".trash-{name}")
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                removed.pop()  # a retry took it meanwhile
                continue
            if os.path.isdir(trash) and not os.path.islink(trash):
                _remove_tree(trash)
            else:
                os.unlink(trash)
        if removed and not dry_run:
            fsync_dir(folder)
    if removed and not dry_run:
        _prune_tag_index(workspace, notes if notes is not None else [])
        _prune_keys(workspace)
        remove_states_of(states_folder(workspace, str(setting_default("cache_dir"))), set(removed))
    return removed


def _prune_tag_index(workspace: str, notes: list[str]) -> None:
    """Delete tag index files none of whose jobs exist any more (and then empty tag dirs)."""
    tags = os.path.join(workspace, TAGS)
    try:
        names = os.listdir(tags)
    except FileNotFoundError:
        return
    writing = os.path.join(workspace, WRITING)
    alive = set(os.listdir(writing))  # a submit in progress: listed first, as jobs move forward
    alive.update(_all_jobs(workspace))
    flow = Flow(workspace)
    for tag in names:
        if not ID_PATTERN.fullmatch(tag):
            continue
        try:
            files = list(_tag_files(workspace, tag))
        except WorkspaceError as err:  # not nrvna's, or damaged: left as it is, the rest cleaned
            notes.append(f"{err}; left as it is")
            continue
        for chunk_file, rows in files:
            if any(job_id in alive for job_id, _ in rows):
                continue
            # Looked up again one by one: a job moved backwards (requeued) while we listed.
            if all(flow.status(job_id) is Status.Missing and not os.path.lexists(os.path.join(writing, job_id))
                   for job_id, _ in rows):
                _unlink_quietly(os.path.join(tags, tag, chunk_file), None)
        if not _tag_known(workspace, tag):  # its last index went: the shard it was created with goes too
            _unlink_quietly(os.path.join(tags, tag, SHARD_RECORD), None)
        try:
            os.rmdir(os.path.join(tags, tag))
        except OSError:
            continue  # not empty
        _unlink_quietly(os.path.join(workspace, HOOKS_BATCH, tag), None)  # its batch hook's record


def _finished_at(path: str) -> float:
    try:
        fd = open_dir(path)
    except OSError:
        return os.lstat(path).st_mtime
    try:
        finished = read_meta(fd).get("finished")
        return float(finished) if isinstance(finished, (int, float)) else os.fstat(fd).st_mtime
    finally:
        os.close(fd)


# ============================================================================
# 9.5 Daemons: info and stop
# ============================================================================
# daemon_info reads the daemons' records; stop_daemon signals only a pid proven to be a live
# daemon of this workspace (its lock, its record and the process agree).


_DAEMON_NAME = re.compile(r"([0-9]+)-[0-9]+")  # register_daemon's <pid>-<ns>


def daemon_info(workspace: str) -> list[dict[str, Any]]:
    """Every running daemon's record, oldest first: pid, name, models (each with its path,
    kind and whether it is loaded), GPU, workers, counters, tokens/s; ``{"pid", "name",
    "starting": True}`` while one registers. Raise NoSuchJob when no daemon runs (decided by
    each daemon's lock, never by a stale file)."""
    require_workspace(workspace)
    records = daemon_records(workspace)
    if not records:
        raise NoSuchJob(f"no daemon is running on {workspace}")
    return records


def _holds_lock(pid: int, lock: os.stat_result) -> Optional[bool]:
    """Whether process ``pid`` holds a flock on the file ``lock`` through a descriptor of its
    own (Linux: /proc/<pid>/fd and fdinfo's lock lines); None where /proc cannot say."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    folder = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(folder)
    except FileNotFoundError:
        return False
    for fd in fds:
        try:
            seen = os.stat(os.path.join(folder, fd))
            if (seen.st_dev, seen.st_ino) != (lock.st_dev, lock.st_ino):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as handle:
                if any(line.startswith("lock:") and " FLOCK " in line for line in handle):
                    return True
        except (FileNotFoundError, NotADirectoryError):
            continue
    return False


def _proven_daemon(workspace: str, record: dict[str, Any]) -> tuple[Optional[int], str]:
    """``(pid, "")`` when ``record`` (from daemon_records) is proven a live daemon of
    ``workspace``: its name is ``<pid>-<ns>``, its record and its lock file say that pid (an
    int above 1), and that process holds the lock (on Linux, seen in /proc; elsewhere, the
    process exists and the lock is held). Else ``(None, why)``: stop signals nothing on the
    word of a file (a pid of -1 or 0 would signal every process, or the caller's group).
    Raise NrvnaError when /proc shows the process but not its descriptors (another user's)."""
    name = record.get("name")
    match = _DAEMON_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None, "its name is not <pid>-<number>"
    pid = record.get("pid")
    if type(pid) is not int or pid <= 1 or pid != int(match.group(1)):
        return None, f"its record's pid ({pid!r}) is not the pid its name starts with"
    path = os.path.join(workspace, DAEMONS, f"{name}.lock")
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        try:
            lock, written = os.fstat(fd), os.read(fd, 32)
        finally:
            os.close(fd)
    except OSError as err:
        return None, f"its lock cannot be read: {_os_error(err)}"
    if written.strip() != str(pid).encode():
        return None, f"its lock file does not hold pid {pid}"
    try:
        held = _holds_lock(pid, lock)
    except PermissionError:
        raise NrvnaError(f"not allowed to signal the daemon (pid {pid}): its descriptors cannot be read") from None
    if held is None:
        held = _process_exists(pid) and daemon_alive(workspace, name)
    return (pid, "") if held else (None, f"pid {pid} is not a live process holding it")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_proven(workspace: str, record: dict[str, Any]) -> Optional[str]:
    """SIGTERM the daemon of ``record`` once proven (see _proven_daemon); the reason it was
    left alone, else None. Through a pidfd where there is one, taken before the proof: the
    signal reaches the process that was proven or none, even if its pid was reused meanwhile."""
    import signal

    pidfd = -1
    pid = record.get("pid")
    if hasattr(os, "pidfd_open") and type(pid) is int and pid > 1:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return f"no process has pid {pid}"
        except OSError:
            pidfd = -1  # pidfds unsupported here: os.kill below, after the proof
    try:
        pid, why = _proven_daemon(workspace, record)
        if pid is None:
            return why
        try:
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise NrvnaError(f"not allowed to signal the daemon (pid {pid})") from None
        return None
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def stop_daemon(workspace: str, timeout: Optional[float] = None, pid: Optional[int] = None,
                notes: Optional[list[str]] = None) -> list[int]:
    """Send SIGTERM to every daemon of ``workspace`` (or only to the one with ``pid``) and
    wait until each has let go (its in-flight jobs are back in the queue); return their pids.
    Only a pid proven a live daemon of this workspace is signalled (_proven_daemon); each lock
    in daemons/ that is held but not proven is left alone, one line for it in ``notes``.
    Raise NoSuchJob when none runs (or none has that pid), NotFinished when one still runs
    after ``timeout`` seconds."""
    records = [r for r in daemon_info(workspace) if pid is None or r.get("pid") == pid]
    deadline = None if timeout is None else time.monotonic() + timeout
    stopped = []
    for record in records:
        why = _signal_proven(workspace, record)
        if why is None:
            stopped.append(record)
        elif notes is not None:
            notes.append(f"{DAEMONS}/{record.get('name')}.lock is held but left alone: {why}")
    if not stopped:
        raise NoSuchJob(f"no daemon{'' if pid is None else f' with pid {pid}'} is running on {workspace}")
    for record in stopped:
        while daemon_alive(workspace, record["name"]):
            if deadline is not None and time.monotonic() > deadline:
                raise NotFinished(f"the daemon (pid {record['pid']}) has not stopped after {timeout:g} s")
            time.sleep(0.05)
    return [record["pid"] for record in stopped]


# ============================================================================
# 9.6 Metrics
# ============================================================================
# metrics_text: the workspace's figures in Prometheus' text format (`nrvna metrics`, a server's GET
# /metrics); the recent rate of a selection's finishes (the ETA of `status --tag` and `wait`). Read
# only, from the files alone. Any client thread: a process's cache of jobs read is under its lock.


# Each metric metrics_text writes: its type, its labels and its help (the HELP lines and the manual's
# table). The jobs' figures are gauges of the present: sums over the jobs the workspace holds now,
# which a clean or a retry lowers; a daemon's counters grow while it lives (its name is a label).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "nrvna_jobs": ("gauge", ("state", "model"), "Jobs in each state (queued, running, done, failed) by model: a "
                   "queued job's is the model it names (empty: the default), a started job's the model that ran it."),
    "nrvna_tag_jobs": ("gauge", ("tag", "state"), "Each tag's jobs in each state, as nrvna status --tag counts them."),
    "nrvna_failed_jobs": ("gauge", ("code", "model"),
                          "Failed jobs by failure code (other: a code nrvna never writes)."),
    "nrvna_generated_tokens": ("gauge", ("model",), "Tokens generated by the finished jobs (done and failed) the "
                               "workspace holds."),
    "nrvna_prompt_tokens": ("gauge", ("model", "source"), "Prompt tokens of the finished jobs the workspace holds: "
                            "computed, reused from memory (a context's cells) or disk (a saved state), or unstated "
                            "(a runner that does not say); the four add up to the prompts' tokens."),
    "nrvna_oldest_queued_seconds": ("gauge", (),
                                    "Age of the oldest queued job, since its submission (0: none queued)."),
    "nrvna_daemons": ("gauge", (), "Live daemons: each holds its lock in daemons/."),
    "nrvna_daemon_model_loaded": ("gauge", ("daemon", "model", "kind"), "1 for each model a live daemon has "
                                  "loaded, 0 for one it serves and has not loaded."),
    "nrvna_daemon_model_memory_bytes": ("gauge", ("daemon", "model"), "Memory of a loaded model as llama.cpp states "
                                        "it: weights, KV cache, compute and output buffers, embedding contexts."),
    "nrvna_daemon_running_jobs": ("gauge", ("daemon",), "Jobs a live daemon is running."),
    "nrvna_daemon_tokens_per_second": ("gauge", ("daemon",), "Tokens a live daemon generated a second, over the "
                                       "last minute."),
    "nrvna_daemon_jobs_total": ("counter", ("daemon", "outcome"), "Jobs a live daemon has ended (done or failed) "
                                "since it started."),
    "nrvna_daemon_generated_tokens_total": ("counter", ("daemon",), "Tokens a live daemon has generated since it "
                                            "started."),
    "nrvna_unreadable_tag_indexes": ("gauge", (), "Tags whose index cannot be read whole: nrvna_tag_jobs leaves "
                                     "them out (nrvna status --tag names the file)."),
    "nrvna_metrics_seconds": ("gauge", (), "Seconds this reading of the workspace took."),
}
# A process keeps what it read of a workspace of up to this many jobs (about 0.5 KB a job: 45 MiB for
# 100,000, measured); a larger one is read whole at every call (4 to 6 s of CPU for 100,000 jobs).
METRICS_CACHE_JOBS = 200_000
RATE_FINISHES = 100  # an ETA's rate is taken over at most this many of the latest finishes...
RATE_SECONDS = 900.0  # ...that ended within this many seconds: a rate of last week says nothing of now
# A job's figures: the model label, its failure code, its tokens (generated, prompt, computed,
# reused from memory, from disk) and, queued, when it was submitted.
_Figures = namedtuple("_Figures", "model code generated prompt computed memory disk submitted")
_METRICS_CACHES: dict[str, "_MetricsCache"] = {}  # workspace's real path -> its cache in this process
_METRICS_LOCK = threading.Lock()


def _label_text(text: str, quoted: bool = True) -> str:
    """``text`` as the text format writes a label's value (``quoted``) or a HELP line: a
    backslash and a newline escaped (and a double quote); a lone surrogate (JSON's "\\ud800",
    a file name's undecodable byte) written as its escape, since the format is UTF-8."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quoted else text


def _is_amount(value: Any) -> bool:
    """A finite number of 0 or more, below 2^53 (never NaN, an infinity, a bool or a text)."""
    return type(value) in (int, float) and 0 <= value < 1 << 53


def _exposition(samples: Mapping[str, Mapping[tuple[str, ...], float]]) -> str:
    """Every metric of METRICS, with its HELP and TYPE lines, then its samples sorted by label."""
    lines = []
    for name, (kind, labels, help) in METRICS.items():
        lines += [f"# HELP {name} {_label_text(help, quoted=False)}", f"# TYPE {name} {kind}"]
        for values, value in sorted(samples.get(name, {}).items()):
            shown = ",".join(f'{label}="{_label_text(text)}"' for label, text in zip(labels, values))
            number = str(value) if type(value) is int else repr(float(value))
            lines.append(f"{name}{{{shown}}} {number}" if labels else f"{name} {number}")
    return "\n".join(lines) + "\n"


def _read_figures(job_dir: str, status: Status) -> _Figures:
    """What metrics_text counts of one job: its meta.json's fields read as job_meta checks them
    (a field of another type is absent), and the model its params.json names when meta.json
    names none (a queued job, one cancelled before it ran). A FIFO, a link or a file over 1 MiB
    reads as no meta.json (read_record), a params.json as read_route reads it."""
    record = {} if status is Status.Queued else read_record(os.path.join(job_dir, META_FILE))
    meta = {k: v for k, v in record.items() if k in META_FIELDS and META_FIELDS[k](v)}
    model = meta.get("model")
    if model is None:
        model = read_route(job_dir).model or ""
    reused = meta.get("prompt_reused") or {}
    submitted = None
    if status is Status.Queued:
        match = GENERATED_ID.fullmatch(os.path.basename(job_dir))
        try:
            submitted = os.stat(os.path.join(job_dir, PROMPT_FILE), follow_symlinks=False).st_mtime
        except OSError:
            submitted = float(match.group(1)) if match else None
    code = meta.get("code") if status is Status.Failed else None
    return _Figures(model, code if code is None or code in FAILURE_CODES else "other", meta.get("generated_tokens", 0),
                    meta.get("prompt_tokens", 0), meta.get("prompt_computed", 0), reused.get("memory", 0),
                    reused.get("disk", 0), submitted)


class _MetricsCache:
    """What metrics_text has read of one workspace's jobs and tag indexes, in one process, kept
    as running sums, so that a call reads only what changed since the last: a queued or done
    job is known by its directory's inode (a done job's files are final before its move to
    output/ and nothing rewrites them; a queued job's params.json is written once), a failed
    one also by its meta.json's inode, size and mtime (cancel and retry rewrite it), a tag
    index file by its name, inode, size and mtime; a running job is read at every call. A job
    that moves or is replaced under its name is read again, one that goes is taken out of the
    sums: the counts are those a first call gives. Kept while the workspace holds at most
    METRICS_CACHE_JOBS jobs.

    Threads: any thread of a client process (a server's handlers) => ``lock``, held for a whole
    call: calls on one workspace take turns."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.passes = 0
        self.seen: dict[str, tuple[str, Any]] = {}  # job -> (its state's name, what it was known by)
        self.figures: dict[str, _Figures] = {}
        self.totals: dict[tuple[str, str, Optional[str]], list[int]] = {}  # (state, model, code) -> sums
        self.groups: dict[tuple[str, str, Optional[str]], tuple[str, str, Optional[str]]] = {}  # one key each
        self.tags: dict[str, tuple[Any, Optional[frozenset[str]]]] = {}  # tag -> (its files, its jobs or None)

    def listing(self, workspace: str) -> dict[str, tuple[str, Any]]:
        """Every job once, in its latest state (the state directories are listed in lifecycle
        order), with what it is known by. States by name: hashing a Status is a Python call."""
        self.passes += 1
        found: dict[str, tuple[str, Any]] = {}
        for sub, state in STATE_DIRS:
            status = state.value
            try:
                with os.scandir(job_path(workspace, sub)) as listing:
                    entries = [(e.name, e.inode()) for e in listing if not e.name.startswith(".")]
            except (FileNotFoundError, NotADirectoryError):
                continue
            if state is Status.Running:  # read at every call
                found.update((name, (status, (inode, self.passes))) for name, inode in entries)
            elif state is Status.Failed:
                for name, inode in entries:
                    try:
                        meta = os.stat(os.path.join(workspace, sub, name, META_FILE), follow_symlinks=False)
                        found[name] = (status, (inode, meta.st_ino, meta.st_size, meta.st_mtime_ns))
                    except OSError:
                        found[name] = (status, (inode, None))
            else:
                found.update((name, (status, inode)) for name, inode in entries)
        return found

    def count(self, status: str, found: _Figures, sign: int) -> _Figures:
        """Add ``found`` to its group's sums (``sign`` 1), or take it out (-1); ``found`` with its
        group's model text (one copy a group, not one a job)."""
        group = self.groups.setdefault((status, found.model, found.code), (status, found.model, found.code))
        sums = self.totals.setdefault(group, [0] * 6)
        for i, value in enumerate((1, found.generated, found.prompt, found.computed, found.memory, found.disk)):
            sums[i] += sign * value
        if not sums[0]:
            del self.totals[group], self.groups[group]
        return found if found.model is group[1] else _Figures(group[1], *found[1:])

    def refresh(self, workspace: str) -> dict[str, str]:
        """Bring the sums up to the workspace's jobs now; every job's state (its name)."""
        current = self.listing(workspace)
        for name, (status, _) in self.seen.items() - current.items():
            self.count(status, self.figures.pop(name), -1)
        for name, (status, _) in current.items() - self.seen.items():
            found = _read_figures(job_path(workspace, STATUS_DIR[Status(status)], name), Status(status))
            self.figures[name] = self.count(status, found, 1)
        self.seen = current
        return {name: status for name, (status, _) in current.items()}

    def tag_jobs(self, workspace: str, tag: str) -> Optional[frozenset[str]]:
        """The jobs ``tag``'s index names (read again when one of its files changed); None when it
        cannot be read whole (_tag_files)."""
        folder = os.path.join(workspace, TAGS, tag)
        try:
            files = tuple(sorted((name, info.st_ino, info.st_size, info.st_mtime_ns) for name, info in (
                (name, os.stat(os.path.join(folder, name), follow_symlinks=False))
                for name in os.listdir(folder) if name.endswith(".ids") and not name.startswith("."))))
        except OSError:
            files = None
        known = self.tags.get(tag)
        if files is not None and known is not None and known[0] == files:
            return known[1]
        try:
            members: Optional[frozenset[str]] = frozenset(
                job_id for _, rows in _tag_files(workspace, tag) for job_id, _ in rows)
        except WorkspaceError:
            members = None
        self.tags[tag] = (files, members)
        return members


def _job_samples(cache: _MetricsCache, samples: dict[str, dict[tuple[str, ...], Any]]) -> None:
    """nrvna_jobs, nrvna_failed_jobs, the tokens and the oldest queued job's age, from the sums."""
    for (status, model, code), (jobs, generated, prompt, computed, memory, disk) in cache.totals.items():
        key = (status, model)
        samples["nrvna_jobs"][key] = samples["nrvna_jobs"].get(key, 0) + jobs
        if status == Status.Failed.value:
            key = (code or "other", model)
            samples["nrvna_failed_jobs"][key] = samples["nrvna_failed_jobs"].get(key, 0) + jobs
        if status not in (Status.Done.value, Status.Failed.value):
            continue
        unstated = max(0, prompt - computed - memory - disk)
        for metric, key, count in (("nrvna_generated_tokens", (model,), generated),
                                   ("nrvna_prompt_tokens", (model, "computed"), computed),
                                   ("nrvna_prompt_tokens", (model, "memory"), memory),
                                   ("nrvna_prompt_tokens", (model, "disk"), disk),
                                   ("nrvna_prompt_tokens", (model, "unstated"), unstated)):
            samples[metric][key] = samples[metric].get(key, 0) + count
    queued = [cache.figures[name].submitted for name, (status, _) in cache.seen.items() if status == "queued"]
    oldest = min((t for t in queued if t is not None), default=None)
    samples["nrvna_oldest_queued_seconds"][()] = 0 if oldest is None else round(max(0.0, time.time() - oldest), 3)


def _tag_samples(workspace: str, cache: _MetricsCache, states: Mapping[str, str],
                 samples: dict[str, dict[tuple[str, ...], Any]]) -> None:
    """nrvna_tag_jobs (each job once a tag, as select counts it) and nrvna_unreadable_tag_indexes."""
    try:
        tags = sorted(name for name in os.listdir(os.path.join(workspace, TAGS)) if ID_PATTERN.fullmatch(name))
    except OSError:
        tags = []
    for gone in set(cache.tags) - set(tags):
        del cache.tags[gone]
    unreadable = 0
    for tag in tags:
        members = cache.tag_jobs(workspace, tag)
        if members is None:
            unreadable += 1
            continue
        counts = Counter(map(states.get, members))
        samples["nrvna_tag_jobs"].update(((tag, status.value), counts[status.value]) for _, status in STATE_DIRS)
    samples["nrvna_unreadable_tag_indexes"][()] = unreadable


def _daemon_samples(workspace: str, samples: dict[str, dict[tuple[str, ...], Any]]) -> None:
    """The live daemons' figures from their records (daemon_records: each field checked here too:
    a record another process planted may hold any JSON, NaN and 1e999 included)."""
    records = daemon_records(workspace)
    samples["nrvna_daemons"][()] = len(records)
    for record in records:
        name = record["name"]
        for field, metric, key in (("running", "nrvna_daemon_running_jobs", (name,)),
                                   ("jobs_done", "nrvna_daemon_jobs_total", (name, "done")),
                                   ("jobs_failed", "nrvna_daemon_jobs_total", (name, "failed")),
                                   ("tokens_generated", "nrvna_daemon_generated_tokens_total", (name,))):
            if _is_count(record.get(field)):
                samples[metric][key] = record[field]
        if _is_amount(record.get("tokens_per_second_last_minute")):
            samples["nrvna_daemon_tokens_per_second"][(name,)] = record["tokens_per_second_last_minute"]
        for model in record.get("models") or ():
            label = model.get("name") if _is_text(model.get("name")) else ""
            kind = model.get("kind") if _is_text(model.get("kind")) else ""
            samples["nrvna_daemon_model_loaded"][(name, label, kind)] = int(model.get("loaded") is True)
            memory = model.get("memory")
            total = memory.get("total_mib") if isinstance(memory, dict) else None
            if model.get("loaded") is True and _is_amount(total) and total < 1 << 32:
                samples["nrvna_daemon_model_memory_bytes"][(name, label)] = round(total * _MIB)


def metrics_text(workspace: str) -> str:
    """The workspace's figures in Prometheus' text exposition format (0.0.4): every metric of
    METRICS with its HELP and TYPE lines, label values escaped. Derived from the workspace's
    files alone, written nowhere: `nrvna metrics` prints it, a server's GET /metrics answers
    it. A process keeps what it read of each job (_MetricsCache): a second call reads only the
    jobs that changed, and counts as a first would. InvalidInput when ``workspace`` is not one."""
    workspace = os.fspath(workspace)
    require_workspace(workspace)
    began = time.monotonic()
    samples: dict[str, dict[tuple[str, ...], Any]] = {name: {} for name in METRICS}
    with _METRICS_LOCK:
        cache = _METRICS_CACHES.setdefault(os.path.realpath(workspace), _MetricsCache())
    with cache.lock:
        states = cache.refresh(workspace)
        _job_samples(cache, samples)
        _tag_samples(workspace, cache, states, samples)
        if len(states) > METRICS_CACHE_JOBS:  # read whole at every call, never kept
            with _METRICS_LOCK:
                _METRICS_CACHES.pop(os.path.realpath(workspace), None)
    _daemon_samples(workspace, samples)
    samples["nrvna_metrics_seconds"][()] = round(time.monotonic() - began, 6)
    return _exposition(samples)


def recent_finishes(workspace: str, states: Mapping[str, Status], most: int = RATE_FINISHES) -> list[float]:
    """When the last ``most`` finished jobs of ``states`` (ID -> state, in submission order, as
    Flow.select gives a tag's jobs or every job) ended, by their meta.json's ``finished``,
    oldest first. A lane's jobs are taken in submission order, so these are about its latest
    finishes, read in ``most`` files however many jobs there are. A job without a valid time
    (a hand-made or damaged meta.json: read_record's checks, then _is_time) is left out."""
    latest = []
    for job_id in reversed(list(states)):
        if states[job_id].finished:
            latest.append(job_id)
            if len(latest) >= most:
                break
    times = []
    for job_id in latest:
        finished = read_record(os.path.join(job_path(workspace, STATUS_DIR[states[job_id]], job_id), META_FILE)).get(
            "finished")
        if _is_time(finished):
            times.append(float(finished))
    return sorted(times)


def finish_rate(times: Iterable[float], now: float) -> Optional[float]:
    """Jobs ended a second, from finish ``times``: of the latest RATE_FINISHES that ended within
    RATE_SECONDS before ``now``, the finishes after the first over the time from it to now (so
    the rate falls while nothing ends). None with fewer than two: no rate yet, an ETA unknown."""
    recent = sorted(t for t in times if now - RATE_SECONDS <= t <= now + 1.0)[-RATE_FINISHES:]
    if len(recent) < 2:
        return None
    return (len(recent) - 1) / max(now - recent[0], 1e-3)


##############################################################################
# 10. Runner protocol: what a worker runs. A Runner makes one Session per worker; a Session holds
# up to free() more jobs and advances them all one step at a time
##############################################################################
# Owns the interface between the daemon and an engine: Runner, Session, RunningJob, Outcome.
# Invariant: a Session is used by one worker thread only; FunctionRunner is the library's engine.


class Outcome(namedtuple("Outcome", "text finish_reason prompt_tokens generated_tokens error_code error logprobs "
                                     "choices prompt_computed reasoning reasoning_tokens thinking_closed prompt_reused "
                                     "message", defaults=("", "stop", 0, 0, None, None, None, None, None, None, 0, None,
                                                          None, None))):
    """How a job ended: a result (``error_code`` None) or a failure with a short code and a
    message. ``text`` is the generated text (partial text for a failure); ``logprobs`` the
    tokens' log-probabilities in OpenAI's shape (``[{token, logprob, bytes, top_logprobs}]``)
    when the job asked for them, else None. A job of n > 1 choices has ``choices``: one
    ``{index, text, finish_reason, generated_tokens[, logprobs]}`` per choice (the fields
    above are the first choice's, but ``generated_tokens``: every choice's).
    ``prompt_computed``: the prompt tokens the engine computed for the job, every choice's
    (the others' cells were shared), or None where the runner does not say. A thinking model's
    job has its thinking in ``reasoning`` ("" when it had none), the tokens of its thinking
    block in ``reasoning_tokens`` (every choice's), and ``thinking_closed``: why the daemon
    closed the block (budget, share, eog or model; None where the model closed it).
    ``prompt_reused``: where the prompt tokens not computed came from, ``{"memory": N, "disk":
    M}`` (a context's cells, a saved state), or None where the runner does not say.
    ``message``: an answer of tool calls, ``{"content": str | None, "tool_calls": [...]}``
    (finish_reason ``tool_calls``; ``text`` is the model's own text), else None."""

    __slots__ = ()


class RunningJob:
    """A job a worker has claimed: what a runner sees of it.

    A runner reads ``prompt`` and ``params``, passes generated text to ``emit`` (the daemon
    appends it to partial.txt for ``nrvna get --follow``), and stops between tokens when
    ``stop`` is set (shutdown: the job goes back to the queue) or ``interrupt`` is not None
    (``(code, message)``: cancelled or timed out; the job fails with its partial text).
    """

    __slots__ = ("id", "prompt", "params", "stop", "started", "interrupt", "emitted")

    def __init__(self, job_id: str, prompt: str, params: dict[str, Any], stop: threading.Event) -> None:
        self.id = job_id
        self.prompt = prompt
        self.params = params
        self.stop = stop  # set when the daemon shuts down: stop between tokens
        self.started = time.monotonic()
        self.interrupt: Optional[tuple[str, str]] = None
        self.emitted: Any = deque()  # text not yet in partial.txt (deque: safe across threads)

    def emit(self, text: str) -> None:
        """Report newly generated text (safe from any thread)."""
        if text:
            self.emitted.append(text)


class Session:
    """One worker's share of a runner: up to ``free()`` more jobs at a time, advanced together
    by ``step()``. The daemon calls a session from its own worker thread only, so a session
    needs no lock (and must not share mutable state with other sessions without one).

    The worker's loop: while ``free() > 0`` it claims a job and calls ``start(job)``; then, if
    ``active()``, it calls ``step()`` and records each returned outcome; ``idle()`` when it has
    nothing to do; ``drop(job)`` before handing a job back to the queue (shutdown);
    ``close()`` once at the end. Subclasses implement the methods that raise
    NotImplementedError; the others have working defaults.
    """

    base_threads = 0  # CPU threads of its own: 1 lets idle workers lend it theirs (set_threads)

    def free(self) -> int:
        """How many more jobs ``start`` can take now (0 when full)."""
        raise NotImplementedError

    def reserve(self, priority: int) -> int:
        """How many jobs of ``priority`` ``start`` can take beyond ``free()``: room kept for a
        job above every running one, which pauses them while it runs (0: none kept)."""
        return 0

    def start(self, job: RunningJob) -> None:
        """Take ``job`` in. Raise JobError to fail it at once (e.g. ``context_overflow``)."""
        raise NotImplementedError

    def step(self) -> list[tuple[RunningJob, Outcome]]:
        """Advance every job a little (one token each, for llama.cpp); return the jobs that
        ended, each with its Outcome, and forget them. A job whose ``interrupt`` is set must
        end with that failure; one that sees ``stop`` set may be left running (the daemon
        drops it and hands it back). An exception fails every active job (runner_error)."""
        raise NotImplementedError

    def active(self) -> list[RunningJob]:
        """The jobs started and not yet ended or dropped."""
        raise NotImplementedError

    def drop(self, job: RunningJob) -> None:
        """Forget ``job`` without an outcome (it goes back to the queue)."""
        raise NotImplementedError

    def idle(self) -> None:
        """Called when the worker has no job and none is queued (a chance to tidy up)."""

    def set_threads(self, threads: int) -> None:
        """Decode with ``threads`` CPU threads from the next step on (lent by idle workers)."""

    def preempt(self) -> None:
        """Cut the step in progress short if the session can (any thread may call this): a job
        above its jobs is waiting. The cut step changes nothing; the next one redoes it."""

    def clear_preempt(self) -> None:
        """Forget an earlier ``preempt`` (the worker's thread, before it decides what to step)."""

    def close(self) -> None:
        """Free what the session holds; no other call follows."""


class Runner:
    """What a worker runs: the daemon asks it for one Session per worker at start, and closes
    it at shutdown. ``LlamaRunner`` is llama.cpp; ``FunctionRunner`` wraps a plain function
    (tests, custom back ends)."""

    name = "runner"  # the model name meta.json records when there is no model file

    def session(self, index: int, config: Config) -> Session:
        """Worker ``index``'s session; raise ModelError if it cannot be made."""
        raise NotImplementedError

    def memory(self) -> Optional[dict[str, Any]]:
        """What the runner holds in memory, as the start line and `status --daemon` state it
        (MiB; see model_memory), or None where it cannot say."""
        return None

    def close(self) -> None:
        """Free what the runner holds; called once, after every session is closed."""


class FunctionRunner(Runner):
    """Wraps ``fn(job) -> str | Outcome`` as a runner (one job per worker at a time).

    For tests and custom back-ends. ``fn`` may raise JobError to fail the job with a code,
    or Interrupted (after seeing ``job.stop`` set) to hand it back to the queue.
    """

    name = "function"

    def __init__(self, fn: Callable[[RunningJob], Any], capacity: int = 1) -> None:
        self.fn = fn
        self.capacity = capacity

    def session(self, index: int, config: Config) -> "_FunctionSession":
        """A worker's session."""
        return _FunctionSession(self.fn, self.capacity)


class _FunctionSession(Session):
    def __init__(self, fn: Callable[[RunningJob], Any], capacity: int) -> None:
        self.fn = fn
        self.capacity = capacity
        self.jobs: list[RunningJob] = []

    def free(self) -> int:
        return self.capacity - len(self.jobs)

    def active(self) -> list[RunningJob]:
        return list(self.jobs)

    def start(self, job: RunningJob) -> None:
        self.jobs.append(job)

    def step(self) -> list[tuple[RunningJob, Outcome]]:
        job = self.jobs[0]
        try:
            value = self.fn(job)
        except Interrupted:
            return []  # the worker hands it back to the queue
        except JobError as err:
            value = Outcome(error_code=err.code, error=str(err))
        self.jobs.remove(job)
        outcome = value if isinstance(value, Outcome) else Outcome(text=str(value))
        if job.interrupt is not None and outcome.error_code is None:
            outcome = Outcome(outcome.text, "error", error_code=job.interrupt[0], error=job.interrupt[1])
        return [(job, outcome)]

    def drop(self, job: RunningJob) -> None:
        if job in self.jobs:
            self.jobs.remove(job)

    def close(self) -> None:
        self.jobs.clear()


##############################################################################
# 11. llama.cpp engine: one model shared by every worker, one context per worker, continuous batching
##############################################################################
# Owns every call into llama.cpp: loading, grammars, sampling, batching, embeddings. Invariant:
# the model is shared and read only; a context, batch or sampler is one worker's (llama.cpp's rule).
# The workers, the Grammar and Wide threads and the model's loader call in (the Threads table).


# The tags of a thinking block that NRVNA_THINKING_TAGS=auto looks for in a chat template, by its
# close tag: Qwen3, DeepSeek-R1, Phi-4-reasoning; Magistral; Seed-OSS; Command A Reasoning.
THINK_TAGS = (("<seed:think>", "</seed:think>"), ("<think>", "</think>"), ("[THINK]", "[/THINK]"),
              ("<|START_THINKING|>", "<|END_THINKING|>"))
# What follows a close tag the daemon writes, before the answer (as Qwen3's template writes it).
THINK_SEPARATOR = "\n\n"
# gpt-oss's harmony format: the analysis channel is the thinking block, ended by <|end|>; the
# answer is the final channel's message, after its header (HARMONY_HEADERS, which the router drops).
HARMONY_TAGS = ("<|channel|>analysis<|message|>", "<|end|>")
HARMONY_HEADERS = ("<|start|>assistant", "<|channel|>final<|message|>")
# A new prompt waits a step for a batch-mate computing a prefix it shares when that saves
# at least this many tokens of prefill.
PREFIX_WAIT_TOKENS = 16
# The repetition penalty looks back this many generated tokens (llama.cpp's default).
PENALTY_WINDOW = 64
# Distinct grammars a runner keeps converted, and each context keeps parsed.
GRAMMAR_CACHE = 256
CONVERSION_POLL = 0.05  # seconds a session with nothing but grammars being made waits in a step
GRAMMAR_INLINE_BYTES = 4096  # a grammar or schema (without patterns) made on the worker: see _small_grammar
GRAMMAR_TEMPLATES = 16
# A draw its grammar refuses is first redrawn from this many likeliest tokens (see _JobSampler._resample).
SHORTLIST = 4096
# A top_k draw is made from the k likeliest tokens alone (found in one pass over a step's logits:
# see _likeliest) for k below this many strided columns of the vocabulary.
SHORTLIST_COLUMNS = 512
# Architectures that only embed (llama.cpp's encoder-only ones): no generation jobs.
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "neo-bert",
                           "modern-bert", "eurobert", "t5encoder"})
POOLING_CODES = ("none", "mean", "cls", "last", "rank")  # llama_pooling_type's values, by name
# Texts an embedding context takes in one decode at most (one sequence each), and embed jobs
# a worker holds at once.
EMBED_SEQS = 64
EMBED_JOBS = 64
# Tokens packed into one embedding decode (a longer text goes alone). On the CPU a text of
# 20 tokens already keeps the matrix products busy, while attention across a decode grows
# with its square: 256 embedded 10% faster than 512 and 50% faster than 1,024 on SmolLM2
# (and as fast as 512 on MiniLM).
EMBED_PACK = 256
# A context has room for this many jobs of the full per-job length (NRVNA_MAX_CTX / this);
# sequences beyond it run only while the jobs' own budgets leave room (LlamaSession.free).
FULL_LENGTH_SEQS = 8


# ============================================================================
# 11.1 llama.cpp and GGUF files
# ============================================================================
# llama_cpp imported when first needed, its log routed to nrvna's, and a GGUF file's header read
# without llama.cpp in bounded reads (a crafted file is refused, not followed). The log callback
# stays referenced for the process's life (llama.cpp keeps its pointer).


# llama.cpp calls this from any thread; ctypes would free the callback if nothing held it
# and the next log line would then jump into freed memory (a segfault), hence the global.
_llama_log_callback: Any = None
_llama_log_tail: list[str] = []
# llama.cpp states a context's buffers only in its log, one line per backend ("CPU KV buffer size
# = 202.50 MiB", "CUDA0 compute buffer size = ..."): the callback runs on the thread that makes
# the context, so _llama_context collects its own lines here, by thread, while it makes one.
_BUFFER_LINE = re.compile(r"\b(KV|compute|output) buffer size = +([0-9.]+) MiB")
_buffer_sizes: dict[int, dict[str, float]] = {}  # thread ident -> {"KV", "compute", "output": MiB}
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


# A GGUF header's bounds, past which nrvna refuses the file rather than walk it (a crafted
# string array of 2^63 items took hours, 8 bytes at a time). Real models are far inside them:
# tens of keys, and about a million strings in all (a 262k-token vocabulary, or 151k tokens
# and as many merges); a string of a header is a key, a name or a chat template (kilobytes).
GGUF_MAX_KEYS = 1 << 16
GGUF_MAX_KEY_BYTES = 1 << 16  # the GGUF spec's own limit on a key
GGUF_MAX_STRING_BYTES = 1 << 24
GGUF_MAX_ARRAY_STRINGS = 1 << 22  # strings in the header's arrays, all together
_gguf_headers: dict[tuple[int, int, int, int], dict[str, str]] = {}  # (dev, ino, size, mtime) -> strings


def _import_llama() -> Any:
    try:
        import llama_cpp
    except ImportError as err:
        raise ModelError(
            "the daemon needs llama-cpp-python, which the quick start installs in .venv: run "
            "`bash scripts/setup.sh`, then `source .venv/bin/activate` (or use .venv/bin/python); "
            f"to build it yourself see docs/install.md ({err})") from None
    return llama_cpp


def _install_llama_logging(llama: Any, level: str) -> None:
    """Route llama.cpp's chatter to our log at DEBUG (silent unless debug/trace); keep the
    last warning/error lines so a failed load can say why."""
    global _llama_log_callback
    if _llama_log_callback is not None:
        return
    verbose = level in ("debug", "trace")

    def on_log(level_code: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace").rstrip() if text else ""
        if not line:
            return
        if level_code in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
            _llama_log_tail.append(line)
            del _llama_log_tail[:-5]
        sizes = _buffer_sizes.get(threading.get_ident()) if _buffer_sizes else None
        if sizes is not None:
            found = _BUFFER_LINE.search(line)
            if found:
                sizes[found.group(1)] = sizes.get(found.group(1), 0.0) + float(found.group(2))
        if verbose:
            log.debug(f"llama.cpp: {line}")

    _llama_log_callback = llama.llama_log_callback(on_log)
    llama.llama_log_set(_llama_log_callback, None)


def _kv_params(L: Any, config: Config) -> tuple[int, int, int]:
    """A generation context's KV cache types and flash attention (type_k, type_v, flash_attn_type)
    for NRVNA_KV_TYPE: read by _llama_context and by the saved states' fingerprint alike, so a
    state is restored only into a cache laid out as the one it came from."""
    if config.kv_type == "f16":  # llama.cpp's own defaults: flash attention where it helps
        defaults = L.llama_context_default_params()
        return int(defaults.type_k), int(defaults.type_v), int(defaults.flash_attn_type)
    code = KV_TYPES[config.kv_type][0]
    return code, code, int(L.LLAMA_FLASH_ATTN_TYPE_ENABLED)


def _new_context(L: Any, model: Any, params: Any) -> tuple[Any, dict[str, float]]:
    """``llama_init_from_model`` (a null context where it fails: its reason is in _llama_log_tail),
    and the context's buffers as llama.cpp logs them: {"KV", "compute", "output": MiB}."""
    del _llama_log_tail[:]
    sizes = _buffer_sizes[threading.get_ident()] = {}
    try:
        return L.llama_init_from_model(model, params), sizes
    finally:
        del _buffer_sizes[threading.get_ident()]


def _llama_log_reason(form: str) -> str:
    """``form`` filled with llama.cpp's last warning or error line, or "" when there is none.
    (Another thread may append or clear at the same time: one slice reads it whole.)"""
    last = _llama_log_tail[-1:]
    return form.format(last[0]) if last else ""


def _strlen_callback(L: Any) -> Any:
    """libc's strlen as a ggml_abort_callback (see LlamaSession.preempt), where a bool result
    is read from the low byte of the integer register that holds strlen's (x86-64, arm64);
    None elsewhere: steps are then never cut short."""
    import ctypes
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return None
    try:
        return ctypes.cast(ctypes.CDLL(None).strlen, L.ggml_abort_callback)
    except (OSError, AttributeError):
        return None


def _load_unmapped(L: Any, params: Any) -> None:
    """Make ``params`` (llama_model_params) read the weights into memory of their own instead of
    mapping the file. A mapped file truncated in place (cp over it) is SIGBUS at the next touch
    of a page gone: the daemon dies (its jobs are recovered as after any crash); unmapped, the
    weights are the daemon's, whatever happens to the file."""
    fields = {name for name, _ in type(params)._fields_}
    if "load_mode" in fields:  # llama.cpp's load modes (llama-cpp-python 0.3.36)
        params.load_mode = L.LLAMA_LOAD_MODE_NONE
        params.lazy_mode = L.LLAMA_LAZY_MODE_OFF  # lazy rows are read through the mapping
    else:
        params.use_mmap = False


def check_gguf(path: str) -> None:
    """Fail fast, before any queue work, unless ``path`` is a readable file starting GGUF
    whose header (its metadata) is within bounds (see gguf_strings)."""
    _check_gguf_magic(path)
    gguf_strings(path)


class _GgufHeader:
    """A GGUF header read within bounds: each count or length is checked against the bytes
    left in the file and against the GGUF_MAX_* caps before anything is read or skipped, so
    any file is read or refused in time proportional to what a real header holds.

    Threads: the caller's alone (made and read in one call, check_gguf's)."""

    def __init__(self, handle: Any, path: str, size: int) -> None:
        self.handle, self.path, self.size = handle, path, size
        self.strings = 0  # array strings walked so far

    def fail(self, field: str, what: str) -> ModelError:
        return ModelError(f"model {self.path} has a GGUF header out of bounds: {field} {what}")

    def unpack(self, fmt: str, field: str) -> int:
        import struct

        want = struct.calcsize(fmt)
        data = self.handle.read(want)
        if len(data) < want:
            raise self.fail(field, f"is cut short: the file ends at byte {self.size:,}")
        return struct.unpack(fmt, data)[0]

    def count(self, field: str, unit: int, cap: int) -> int:
        """A count (or length) of ``unit``-byte things, refused past ``cap`` or the file's end."""
        number = self.unpack("<Q", field)
        left = self.size - self.handle.tell()
        if number > cap:
            raise self.fail(field, f"says {number:,}, more than the {cap:,} nrvna reads")
        if number * unit > left:
            raise self.fail(field, f"says {number:,}, more than the {left:,} bytes left in the file could hold")
        return number

    def text(self, field: str, cap: int) -> str:
        return self.handle.read(self.count(field, 1, cap)).decode("utf-8", "replace")

    def skip_array(self, key: str) -> None:
        item = self.unpack("<I", f"array {key!r}'s item type")
        if item == _GGUF_STRING:
            number = self.count(f"array {key!r}'s length", 8, GGUF_MAX_ARRAY_STRINGS - self.strings)
            self.strings += number
            self.skip_strings(key, number)
        elif item in _GGUF_SCALARS:
            self.handle.seek(_GGUF_SCALARS[item] * self.count(f"array {key!r}'s length", _GGUF_SCALARS[item],
                                                               1 << 62), 1)
        else:
            raise self.fail(f"array {key!r}'s item type", f"is {item}, not one nrvna reads")

    def skip_strings(self, key: str, number: int) -> None:
        """Skip ``number`` strings, each length checked (the one loop over a vocabulary)."""
        import struct

        read, seek, unpack = self.handle.read, self.handle.seek, struct.Struct("<Q").unpack
        at = self.handle.tell()
        for index in range(number):
            data = read(8)
            length = unpack(data)[0] if len(data) == 8 else -1
            at += 8 + length
            if length < 0 or length > GGUF_MAX_STRING_BYTES or at > self.size:
                raise self.fail(f"string {index} of array {key!r}", f"runs past the file's end (byte {self.size:,})"
                                if length <= GGUF_MAX_STRING_BYTES else
                                f"is {length:,} bytes, more than the {GGUF_MAX_STRING_BYTES:,} nrvna reads")
            seek(length, 1)

    def read(self) -> dict[str, str]:
        """The header's string values (and a pooling type, the one number routing needs)."""
        found: dict[str, str] = {}
        if self.handle.read(4) != b"GGUF":
            raise ModelError(f"model {self.path} is not a GGUF file (it does not start with 'GGUF')")
        version = self.unpack("<I", "the version")
        if version < 2:
            raise self.fail("the version", f"is {version}; nrvna reads GGUF 2 and later")
        self.unpack("<Q", "the tensor count")
        for index in range(self.count("the metadata count", 13, GGUF_MAX_KEYS)):  # 13: the least a key takes
            key = self.text(f"key {index}'s length", GGUF_MAX_KEY_BYTES)
            kind = self.unpack("<I", f"{key!r}'s type")
            if kind == _GGUF_STRING:
                found[key] = self.text(f"{key!r}'s length", GGUF_MAX_STRING_BYTES)
            elif kind == _GGUF_ARRAY:
                self.skip_array(key)
            elif kind in _GGUF_SCALARS:
                value = self.handle.read(_GGUF_SCALARS[kind])
                if len(value) < _GGUF_SCALARS[kind]:
                    raise self.fail(f"{key!r}'s value", f"is cut short: the file ends at byte {self.size:,}")
                if kind in (4, 5) and key.endswith(".pooling_type"):
                    found[key] = str(int.from_bytes(value, "little"))
            else:
                raise self.fail(f"{key!r}'s type", f"is {kind}, not one nrvna reads")
        return found


def gguf_strings(path: str) -> dict[str, str]:
    """A GGUF file's string-valued metadata (and its pooling type), read from its header
    without loading the model (the daemon routes jobs by a model's kind before it loads it).
    Raise ModelError, naming the file and the field, for a header past its bounds (a count
    or a length beyond the file's end or a GGUF_MAX_* cap) or one cut short."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
            known = _gguf_headers.get(key)  # one get: another loader may clear the cache meanwhile
            if known is not None:
                return dict(known)
            log.info(f"Reading the GGUF header of {path} ({info.st_size:,} bytes)")
            found = _GgufHeader(handle, path, info.st_size).read()
    except OSError as err:
        raise ModelError(f"model {path} cannot be read: {_os_error(err)}") from None
    if len(_gguf_headers) >= 64:
        _gguf_headers.clear()
    _gguf_headers[key] = found
    return dict(found)


def gguf_kind(path: str) -> str:
    """"embed" for an embedding model (its GGUF names a pooling type, or its architecture is
    an encoder's: LlamaRunner's own test), else "chat"."""
    meta = gguf_strings(path)
    arch = meta.get("general.architecture", "")
    return "embed" if f"{arch}.pooling_type" in meta or arch in ENCODER_ARCHS else "chat"


# ============================================================================
# 11.2 Grammar conversion
# ============================================================================
# A schema or json_object made a GBNF grammar (llama-cpp-python's converter, with section 5's
# rules in its place), on the runner's Grammar thread (_CallThread) unless small. Invariant: a worker
# never waits for a large conversion; its job waits in its session while the others run.


# {"type": "json_object"}: llama-cpp-python's JSON_GBNF (any object) with its strings made of
# _JSON_CHAR_RULE characters (its own take a lone surrogate escape, and refuse the escape "\/").
_JSON_OBJECT_GBNF = "\n".join([
    'root ::= object',
    'value ::= object | array | string | number | ("true" | "false" | "null") ws',
    'object ::= "{" ws (string ":" ws value ("," ws string ":" ws value)*)? "}" ws',
    'array ::= "[" ws (value ("," ws value)*)? "]" ws',
    'string ::= "\\"" char* "\\"" ws',
    'char ::= ' + _JSON_CHAR_RULE,
    'number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws',
    'ws ::= | " " | "\\n" [ \\t]{0,20}',
    ''])
_schema_converter: Any = None
_GBNF_LITERAL_ESCAPES = {"\\": "\\\\", "\r": "\\r", "\n": "\\n", '"': '\\"'}


class _Conversion:
    """A job's grammar being made on its runner's Grammar thread (LlamaRunner.prepare_grammar):
    ``done`` is set once ``found`` ((key, GBNF, shape), as LlamaRunner.grammar gives) or
    ``error`` (the JobError that fails the jobs waiting for it) is.

    Threads: the Grammar thread writes ``found`` or ``error``, then sets ``done``; the workers
    whose jobs wait for it read them only once ``done`` is set (the Event orders the two)."""

    __slots__ = ("done", "found", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.found: Optional[tuple[Any, str, GrammarShape]] = None
        self.error: Optional[JobError] = None


def schema_to_grammar(schema: Mapping[str, Any], root: str = "") -> str:
    """GBNF for a JSON schema that ``check_json_schema`` accepted: llama-cpp-python's
    converter, with nrvna's numeric bounds and JSON-valid strings (daemon only). ``root``:
    the name of its top rule (default root), for a grammar that wraps it (tool_grammar)."""
    import json

    from llama_cpp import llama_grammar

    global _schema_converter
    if _schema_converter is None:
        _schema_converter = _converter_class(llama_grammar)
    converter = _schema_converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    schema = json.loads(json.dumps(schema))
    if "$ref" in schema:  # the converter's resolve_refs would not look into the $defs beside it
        schema["anyOf"] = [{"$ref": schema.pop("$ref")}]
    converter.visit(converter.resolve_refs(schema, "stdin"), root)
    return converter.format_grammar()


def _converter_class(grammar: Any) -> Any:
    class Converter(grammar.SchemaConverter):  # type: ignore[misc, name-defined]
        def _format_literal(self, literal: str) -> str:
            # The converter escapes quotes and newlines but not backslashes, so a constant
            # "x\\y" came out as the JSON "x\y" (an invalid escape) and "a\nb" as a raw newline.
            return '"' + re.sub(r'[\\\r\n"]', lambda m: _GBNF_LITERAL_ESCAPES[m.group(0)], literal) + '"'

        def _resolve_ref(self, ref: str) -> str:
            # The converter names a reference's rule by its last segment, so a definition
            # named "space" or "string" reused that primitive's rule, and a recursive one named
            # "tree_node" left that raw name in the grammar: give each reference a fresh name.
            names = self.__dict__.setdefault("_nrvna_refs", {})
            if ref not in names:
                number = len(names)
                while f"ref{number}" in self._rules:
                    number += 1
                names[ref] = f"ref{number}"
                self._refs_being_resolved.add(ref)
                try:
                    names[ref] = self.visit(self._refs[ref], names[ref])
                finally:
                    self._refs_being_resolved.discard(ref)
            return names[ref]

        def visit(self, schema: Any, name: str) -> str:
            # The branches check_json_schema checked where the converter's own would drop a
            # keyword: _schema_branch decides them for both
            branch = _schema_branch(schema) if isinstance(schema, dict) else None
            kind = schema.get("type") if isinstance(schema, dict) else None
            rule_name = name + "-" if name in grammar.RESERVED_NAMES else name or "root"
            if branch == "types":  # one schema per type, each with its keywords
                if "const" in schema or "enum" in schema:
                    return self.visit({key: value for key, value in schema.items() if key != "type"}, name)
                return self.visit({"anyOf": type_choices(schema)}, name)
            if branch == "number" and any(key in schema for key in SCHEMA_TYPE_KEYWORDS[kind]):
                rules: dict[str, str] = {}
                expression = number_rule(schema, "", rules, self._fresh_prefix("multiple"))
                self._rules.update(rules)
                return self._add_rule(rule_name, f"({expression}) space")
            if branch == "pattern":
                rules = {}
                expression = string_rule(schema, "", rules, self._fresh_prefix("pattern"))
                self._rules.update(rules)
                return self._add_rule(rule_name, f'"\\"" {expression} "\\"" space')
            return super().visit(schema, name)

        def _fresh_prefix(self, base: str) -> str:
            # the rules of a multipleOf or a pattern: under a name no rule of the grammar starts with
            number = len(self._rules)
            while any(rule == f"{base}{number}" or rule.startswith(f"{base}{number}-") for rule in self._rules):
                number += 1
            return f"{base}{number}"

        def _add_primitive(self, name: str, rule: Any) -> str:
            if name == "char":
                rule = grammar.BuiltinRule(_JSON_CHAR_RULE, [])
            return super()._add_primitive(name, rule)

    return Converter


class _CallThread:
    """A thread that runs the calls handed to it, one at a time, for their callers.

    Threads: any thread hands it calls (``post``, ``call``, ``close``) through a SimpleQueue,
    which is thread-safe; a call's result comes back in its own box, set before its Event."""

    def __init__(self, name: str) -> None:
        import queue

        self._calls: Any = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _name_os_thread(threading.current_thread().name)
        while True:
            task = self._calls.get()
            if task is None:
                return
            fn, args, box, done = task
            try:
                box.append(fn(*args))
            except BaseException as err:  # handed to the caller, raised there
                box.append(err)
            done.set()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on this thread, after the calls before it, without waiting for it
        (``fn`` hands its result over itself)."""
        self._calls.put((fn, args, [], threading.Event()))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this thread; its result, or its exception raised here."""
        box: list[Any] = []
        done = threading.Event()
        self._calls.put((fn, args, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def close(self, wait: bool = True) -> None:
        """Finish the calls handed over, then end the thread (``wait``: before returning)."""
        self._calls.put(None)
        if wait:
            self._thread.join()


def _small_grammar(key: tuple[str, Any]) -> bool:
    """Whether a grammar (its LlamaRunner key) is made inline, by its text, not by time: a
    schema without patterns, or a grammar, of at most GRAMMAR_INLINE_BYTES takes milliseconds,
    and its job begins in the very step it was claimed for, as the same job always does."""
    return key[0] == "json_object" or (len(key[1]) <= GRAMMAR_INLINE_BYTES
                                       and (key[0] == "gbnf" or '"pattern":' not in key[1]))


# ============================================================================
# 11.3 Sampling
# ============================================================================
# _JobSampler: one job's sampling (penalties, logit bias, grammar, top-k/top-p, temperature,
# seed), with _likeliest's shortlist and the per-worker _GrammarTemplates. One worker's session owns
# each.


class _Penalties:
    """llama.cpp's penalties (repetition, frequency, presence) and logit biases, applied in
    place to one sequence's logits.

    Each token among the last ``PENALTY_WINDOW`` generated has its logit divided by the
    repetition penalty if positive, multiplied if not, then lowered by its count times the
    frequency penalty plus the presence penalty: what llama.cpp's penalties sampler does,
    but that sampler looks every vocabulary entry up in a hash map, 80% of sampling time
    (0.16 of 0.20 ms a token on a 49k vocabulary, measured); this touches the window's
    distinct tokens only, in numpy's float32, the floats llama.cpp computes in C. A bias
    is then added to its token's logit, as llama.cpp's logit-bias sampler adds it.

    Threads: one sequence's (its _JobSampler's), on its session's worker thread only.
    """

    __slots__ = ("np", "factor", "frequency", "presence", "bias_ids", "bias_values", "window", "counts")

    def __init__(self, np: Any, repeat: float, frequency: float = 0.0, presence: float = 0.0,
                 bias: Optional[dict[int, float]] = None) -> None:
        self.np = np
        self.factor = np.float32(repeat if repeat > 0 else 1.0)  # the floats llama.cpp would use
        self.frequency, self.presence = np.float32(frequency), np.float32(presence)
        bias = bias or {}  # token -> added to its logit (OpenAI's logit_bias), after the penalties
        self.bias_ids = np.array(list(bias), dtype=np.intp)
        self.bias_values = np.array(list(bias.values()), dtype=np.float32)
        self.window: Any = deque()
        self.counts: dict[int, int] = {}

    def apply(self, row: Any) -> None:
        """Penalise ``row`` (a float32 array: one output row of logits) in place."""
        np, counts = self.np, self.counts
        if counts and (self.factor != 1 or self.frequency or self.presence):
            ids = np.fromiter(counts, dtype=np.intp, count=len(counts))
            values = row[ids]
            values = np.where(values <= 0, values * self.factor, values / self.factor)
            if self.frequency or self.presence:
                times = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                values -= times * self.frequency + self.presence
            row[ids] = values
        if len(self.bias_ids):
            row[self.bias_ids] += self.bias_values  # (ids are distinct: a dict's keys)

    def accept(self, token: int) -> None:
        """``token`` was generated: it enters the window, the oldest may leave."""
        counts = self.counts
        counts[token] = counts.get(token, 0) + 1
        if len(self.window) >= PENALTY_WINDOW:
            old = self.window.popleft()
            counts[old] -= 1
            if not counts[old]:
                del counts[old]
        self.window.append(token)


def _token_entry(data: bytes, logprob: float) -> dict[str, Any]:
    """One token as OpenAI's logprobs give it: its text (a piece of a UTF-8 character shows
    as \\xNN escapes), logprob and bytes."""
    return {"token": data.decode("utf-8", "backslashreplace"), "logprob": logprob, "bytes": list(data)}


def _common_prefix(a: list[int], b: list[int], limit: Optional[int] = None) -> int:
    """How many leading tokens ``a`` and ``b`` share (at most ``limit``)."""
    n, end = 0, min(len(a), len(b), len(b) if limit is None else limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


class _SamplingScratch:
    """A context's arrays for its jobs' samplers, made once rather than per token: the whole
    vocabulary as llama_token_data (a redraw under a grammar; made on first use), a top_k
    draw's shortlist and a single candidate (is one token allowed by a grammar?).

    Threads: a session belongs to one worker thread, and so does its scratch: never shared
    between threads."""

    __slots__ = ("L", "byref", "candidates", "candidates_array", "token_ids", "one", "one_array", "short",
                 "short_ids", "short_logits", "short_p", "short_array", "draws")

    def __init__(self, runner: LlamaRunner) -> None:
        import ctypes

        L = self.L = runner.L
        np = runner.np
        self.byref = ctypes.byref
        # The whole vocabulary as llama_token_data, for resampling under a grammar (see whole_vocabulary).
        self.candidates: Any = None
        self.candidates_array: Any = None
        self.token_ids: Any = None
        self.one = L.llama_token_data(0, 0.0, 0.0)  # one candidate: is a token allowed by a grammar?
        self.one_array = L.llama_token_data_array(ctypes.pointer(self.one), 1, -1, False)
        # A top_k draw's candidates, the k likeliest tokens (see _JobSampler._draw_short).
        self.short = np.zeros(SHORTLIST_COLUMNS, dtype=_token_data_dtype(np))
        self.short_ids, self.short_logits, self.short_p = self.short["id"], self.short["logit"], self.short["p"]
        self.short_array = L.llama_token_data_array(self.short.ctypes.data_as(L.llama_token_data_p), 0, -1, False)
        self.draws = [0, 0]  # draws from the k likeliest tokens, from the whole vocabulary

    def whole_vocabulary(self, np: Any, n_vocab: int) -> None:
        """Make the whole-vocabulary arrays, on the first redraw under a grammar."""
        if self.candidates is None:
            self.candidates = np.zeros(n_vocab, dtype=_token_data_dtype(np))
            self.token_ids = np.arange(n_vocab, dtype=np.intc)
            self.candidates_array = self.L.llama_token_data_array(
                self.candidates.ctypes.data_as(self.L.llama_token_data_p), n_vocab, -1, False)


def _token_data_dtype(np: Any) -> Any:
    """llama_token_data as a numpy record: (id int32, logit float, p float)."""
    return np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


def _likeliest(np: Any, matrix: Any, rows: list[int], ks: list[int]) -> list[Optional[tuple[Any, Any]]]:
    """For each output row ``rows[i]`` of ``matrix`` (a step's logits, one row per output), its
    ``ks[i]`` largest logits as (token IDs, logits), likeliest first, where llama.cpp's top_k
    would keep just those tokens in just that order: no two of the k + 1 largest are equal
    (see _strictly_decreasing), and the row is finite. None where that is not so, or ks[i] is
    not below SHORTLIST_COLUMNS (0: no top_k): the caller draws from the whole vocabulary.

    One vectorized pass over every row: the maxima of SHORTLIST_COLUMNS strided columns of a
    row are that many different tokens' logits, so the (k + 1)-th largest of them is at most
    the row's (k + 1)-th largest logit, and the tokens at or above it (a few dozen) hold the
    k + 1 largest: sorted instead of the vocabulary. (Measured in one session, 16 rows a step
    over SmolLM2's 49,152 tokens: the host's work per token, all but the decode, 42 us with
    this, 73 with llama_sampler_sample, which copies the row and sorts its top k every time.)"""
    columns = SHORTLIST_COLUMNS
    count, n_vocab = matrix.shape
    found: list[Optional[tuple[Any, Any]]] = [None] * len(rows)
    if n_vocab < 2 * columns:
        return found
    depth, (row_stride, stride) = n_vocab // columns, matrix.strides
    strided = np.lib.stride_tricks.as_strided(matrix, shape=(count, depth, columns),
                                              strides=(row_stride, columns * stride, stride))
    maxima = strided.max(axis=1)  # a NaN or an infinity shows in its column's maximum
    usable = np.isfinite(maxima).all(axis=1)
    limits = np.full(count, np.inf, dtype=matrix.dtype)  # rows not asked: no token of a finite row is at +inf
    sizes = np.zeros(count, dtype=np.intp)
    for row, k in zip(rows, ks):
        if 0 < k < columns and usable[row]:
            sizes[row] = k
    for k in set(sizes[sizes > 0].tolist()):  # one k for all, as a rule
        mine = sizes == k
        limits[mine] = np.partition(maxima[mine], columns - 1 - k, axis=1)[:, columns - 1 - k]
    flat = np.flatnonzero(matrix >= limits[:, None])  # (an infinite row's +inf tokens too: never used)
    values = matrix.reshape(-1)[flat]
    owner, ids = np.divmod(flat, n_vocab)
    order = np.lexsort((-values, owner))  # by row, then likeliest first
    values, ids, owner = values[order], ids[order].astype(np.intc), owner[order]
    starts = np.searchsorted(owner, np.arange(count))
    ties = np.concatenate(([0], np.cumsum(~_strictly_decreasing(values))))  # ties[j]: equal neighbours before j
    for i, row in enumerate(rows):
        k, start = int(sizes[row]), int(starts[row])
        if k and ties[start + k] == ties[start]:  # the row's k + 1 largest are k + 1 different logits
            found[i] = (ids[start:start + k], values[start:start + k])
    return found


def _strictly_decreasing(values: Any) -> Any:
    """For each pair of neighbours in ``values`` (sorted likeliest first), whether the first is
    larger: equal logits are a tie. llama.cpp's partial sort orders tied tokens as the whole
    vocabulary happens to lead it, so a draw from a shortlist holding them could land on the
    other one."""
    return values[:-1] > values[1:]


class _GrammarTemplates:
    """A context's parsed grammars: llama.cpp's grammar samplers of the GRAMMAR_TEMPLATES
    grammars used last. A job's own grammar sampler is a clone of one, so a grammar many jobs
    share is parsed once per context. With each, the context's own fork of the grammar's
    GrammarShape, which its jobs count with (its memos fill as they do).

    Threads: like its context, its worker's thread only; the runner's shapes it forks are never
    changed once the runner keeps them, so reading them needs no lock."""

    def __init__(self, runner: LlamaRunner) -> None:
        self.runner = runner
        self.parsed: dict[Any, Any] = {}  # grammar key -> a parsed grammar sampler, cloned per job (LRU)
        # grammar key -> (the runner's shape, this context's fork of it) (LRU, as the runner's)
        self.shapes: dict[Any, tuple[GrammarShape, GrammarShape]] = {}

    def clone(self, params: Mapping[str, Any], made: Optional[tuple[Any, str, GrammarShape]] = None
              ) -> Optional[tuple[Any, GrammarShape]]:
        """A grammar sampler of the job's own and the grammar's shape (None when its output is
        free): cloned from the context's parsed copy of that grammar, parsing it on first use.
        ``made``: the grammar as LlamaRunner.grammar gives it, made already."""
        found = made or self.runner.grammar(params)
        if found is None:
            return None
        key, text, shape = found
        L = self.runner.L
        template = self.parsed.pop(key, None)
        if template is None:
            del _llama_log_tail[:]
            template = L.llama_sampler_init_grammar(self.runner.vocab, text.encode("utf-8"), b"root")
            if not template:
                reason = _llama_log_reason(" ({})")
                raise JobError("bad_request", f"llama.cpp refused the grammar{reason}")
            while len(self.parsed) >= GRAMMAR_TEMPLATES:
                L.llama_sampler_free(self.parsed.pop(next(iter(self.parsed))))
        self.parsed[key] = template  # most recently used last
        return L.llama_sampler_clone(template), self._fork(key, shape)

    def _fork(self, key: Any, shape: GrammarShape) -> GrammarShape:
        """This context's fork of the runner's ``shape``, made on first use: its memos are this
        worker's alone, and kept as long as the runner keeps that shape (within GRAMMAR_CACHE)."""
        found = self.shapes.pop(key, None)
        if found is None or found[0] is not shape:
            found = (shape, shape.fork())
            if len(self.shapes) >= GRAMMAR_CACHE:
                self.shapes.pop(next(iter(self.shapes)))
        self.shapes[key] = found  # most recently used last
        return found[1]

    def close(self) -> None:
        """Free every parsed grammar."""
        for template in self.parsed.values():
            self.runner.L.llama_sampler_free(template)
        self.parsed.clear()
        self.shapes.clear()


def _shortlist_size(chain_settings: tuple[bool, int, float, float]) -> int:
    """How many of a row's likeliest tokens a chain of ``chain_settings`` (greedy, top_k,
    top_p, min_p) draws from, when _likeliest can find them: greedy 1, top_k k; 0 where it
    cannot (no top_k, or one of SHORTLIST_COLUMNS or more), so the whole vocabulary is needed."""
    greedy, top_k = chain_settings[:2]
    if greedy:
        return 1
    return top_k if 0 < top_k < SHORTLIST_COLUMNS else 0


class _JobSampler:
    """How one job picks its tokens from the logits of each step.

    The job's log-probabilities (if asked for) are taken from the raw logits; its penalties
    and logit biases (_Penalties) are applied to them in place; llama.cpp's sampler chain
    (LlamaRunner.sampler) draws; the job's grammar, if any, checks the draw, and a refused
    draw is redrawn under the grammar (see ``_resample``). One per sequence, made when its
    job starts and freed when it ends: the chain and the grammar sampler hold state (the
    random state, where in the grammar the job stands), never shared between jobs.

    Threads: its session's worker thread only; its GrammarShape is its context's own fork
    (see _GrammarTemplates), and what it reads of the runner (pieces, tables, the grammar
    vocabulary) is safe to share (see LlamaRunner).
    """

    __slots__ = ("runner", "L", "scratch", "chain", "chain_settings", "shortlist_size", "penalties", "grammar", "shape",
                 "state", "after", "logprobs", "top_logprobs", "step_logprobs", "thinking", "logged")

    def __init__(self, runner: LlamaRunner, scratch: _SamplingScratch, chain: Any,
                 chain_settings: tuple[bool, int, float, float], penalties: Optional[_Penalties] = None,
                 grammar: Any = None, shape: Optional[GrammarShape] = None, logprobs: bool = False,
                 top_logprobs: int = 0) -> None:
        self.runner = runner
        self.L = runner.L
        self.scratch = scratch  # the context's arrays (see _SamplingScratch)
        self.chain = chain  # llama.cpp's sampler chain (LlamaRunner.sampler); penalties are not in it
        self.chain_settings = chain_settings  # what the chain does: (greedy, top_k, top_p, min_p)
        self.shortlist_size = _shortlist_size(chain_settings)
        self.penalties = penalties
        self.grammar = grammar  # its own grammar sampler (state: where in the grammar it is), or None
        # The grammar as GrammarShape counts it, where it stands, and where a token checked
        # (_allowed) would take it: what llama.cpp's sampler holds, counted.
        self.shape = shape
        self.state: Any = shape.start if shape is not None else None
        self.after: Any = None
        # (token, logprob, [(token, logprob)] of the likeliest) per generated token, if asked
        self.logprobs: Optional[list[tuple[int, float, list[tuple[int, float]]]]] = [] if logprobs else None
        self.top_logprobs = top_logprobs  # how many of the likeliest tokens each entry names
        self.step_logprobs: Any = None  # this step's log-softmax, from sample() until accept()
        # Inside a thinking block (see _ThinkRouter): draws free of the grammar, which starts at
        # the answer, and no log-probabilities, which are the answer's.
        self.thinking = False
        self.logged = False  # this step's token has a log-probability entry (see unlog)

    @classmethod
    def for_job(cls, runner: LlamaRunner, scratch: _SamplingScratch, templates: _GrammarTemplates,
                params: Mapping[str, Any], made: Optional[tuple[Any, str, GrammarShape]] = None) -> _JobSampler:
        """The sampler of a job with ``params`` (``made``: its grammar, made already); raises
        JobError for a logit bias or a grammar the model cannot take."""
        penalties = runner.penalty(params)
        grammar, shape = templates.clone(params, made) or (None, None)
        config = runner.config
        settings = (job_param(params, "temperature", config) <= 0, job_param(params, "top_k", config),
                    job_param(params, "top_p", config), job_param(params, "min_p", config))
        return cls(runner, scratch, runner.sampler(params), settings, penalties, grammar, shape,
                   bool(job_param(params, "logprobs")), job_param(params, "top_logprobs") or 0)

    def prepare(self, row: Any) -> None:
        """Ready the step's ``row`` of logits (a float32 view of the job's output row) for
        ``sample``: their log-probabilities are kept if asked for, then the penalties and
        logit biases change them in place."""
        # Log-probabilities are the model's own: before penalties, biases, grammar, temperature.
        self.step_logprobs = self._log_softmax(row) if self.logprobs is not None and not self.thinking else None
        self.logged = False
        if self.penalties is not None:
            self.penalties.apply(row)

    def sample(self, ctx: Any, index: int, row: Any, likeliest: Optional[tuple[Any, Any]] = None) -> int:
        """The job's next token from output row ``index`` of ``ctx``'s last decode (``row``,
        readied by ``prepare``), or -1 if its grammar allows no token of the vocabulary here;
        raises GrammarLimit where counting the grammar's work passes the limits.
        ``likeliest``: the row's ``shortlist_size`` likeliest tokens, (IDs, logits) likeliest
        first, in which case the chain draws from them alone (see _draw_short); else from the
        whole vocabulary, as llama_sampler_sample does."""
        if likeliest is not None:
            token = self._draw_short(*likeliest)
        else:
            self.scratch.draws[1] += 1
            token = self.L.llama_sampler_sample(self.chain, ctx, index)
        if self.grammar is not None and not self.thinking and not self._allowed(token):
            token = self._resample(row)
        return token

    def _draw_short(self, ids: Any, logits: Any) -> int:
        """The chain's draw given only the k likeliest tokens (``ids``, ``logits``) of a row,
        where its top_k keeps k: the same draw as from the whole row. llama_sampler_sample
        loads the row in token order and applies the chain, whose top_k sorts the k largest
        logits first; with no two of the k + 1 largest equal (_likeliest made sure), that
        leaves exactly these k in one order, so every later sampler (top_p, min_p,
        temperature, the random draw) sees the same array and the random state moves alike.
        Then the chain accepts the token, as llama_sampler_sample's does."""
        scratch = self.scratch
        count = len(ids)
        scratch.short_ids[:count] = ids
        scratch.short_logits[:count] = logits
        scratch.short_p[:count] = 0.0
        array = scratch.short_array
        array.size, array.selected, array.sorted = count, -1, False
        self.L.llama_sampler_apply(self.chain, scratch.byref(array))
        if not 0 <= array.selected < count:  # (llama_sampler_sample would abort the process)
            raise RuntimeError(f"the sampler chain selected candidate {array.selected} of {count}")
        token = int(scratch.short_ids[array.selected])
        self.L.llama_sampler_accept(self.chain, token)
        scratch.draws[0] += 1
        return token

    def accept(self, token: int) -> None:
        """``token``, drawn by ``sample``, is the job's next (not an end-of-generation token
        that ends it): it enters the penalty window, moves the grammar on, and its
        log-probability is recorded."""
        if self.penalties is not None:
            self.penalties.accept(token)
        if self.grammar is not None and not self.thinking:
            self.L.llama_sampler_accept(self.grammar, token)  # never a refused token: llama.cpp aborts on one
            self.state = self.after
        if self.step_logprobs is not None:
            self.logprobs.append(self._logprob(self.step_logprobs, token))
            self.step_logprobs = None
            self.logged = True

    def unlog(self) -> None:
        """Forget this step's log-probability entry: its token was not the answer's."""
        if self.logged:
            self.logprobs.pop()
            self.logged = False

    def free(self) -> None:
        """Free the chain and the grammar sampler (the log-probabilities stay)."""
        if self.chain is not None:
            self.L.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            self.L.llama_sampler_free(self.grammar)
            self.grammar = None

    def _allowed(self, token: int) -> bool:
        """Whether the job's grammar (in its current state) lets ``token`` come next: the
        grammar applied to that one candidate, which costs a few microseconds where the whole
        vocabulary costs milliseconds. Never a control token other than end-of-generation:
        the grammar matches its text (``<|im_start|>``), the result would not hold it.
        GrammarShape walks the token first (raising GrammarLimit past the limits) and keeps
        the state it leads to in ``after``."""
        if token in self.runner.control_tokens:
            return False
        eog = token in self.runner.eog_tokens
        if not eog:
            _, self.after = self.shape.walk(self.state, self.runner.piece(token))
        scratch = self.scratch
        one = scratch.one
        one.id, one.logit, one.p = token, 0.0, 0.0
        array = scratch.one_array
        array.size, array.selected, array.sorted = 1, -1, False
        self.L.llama_sampler_apply(self.grammar, scratch.byref(array))
        allowed = one.logit != -_INF
        if allowed and not eog and self.after is None:
            # (never seen: GrammarShape is llama.cpp's algorithm; were it not, the job ends here
            # rather than run on uncounted)
            raise GrammarLimit(f"nrvna's count of the grammar refused token {token}, which llama.cpp allowed")
        return allowed

    def _resample(self, row: Any) -> int:
        """The job's token drawn again from the tokens its grammar allows (the grammar, then
        its sampler chain), or -1 if the grammar allows none.

        Most tokens a constrained job draws freely are allowed (checked one at a time by
        ``_allowed``); a refused draw is redrawn from the SHORTLIST likeliest tokens when the
        chain is sure to pick from the same set it would pick from in the whole vocabulary
        (see ``_shortlist_suffices``), else from the whole vocabulary, as llama.cpp's
        common_sampler does (measured: 5.8 ms a redraw over SmolLM2's 49,152 tokens)."""
        np, n_vocab = self.runner.np, self.runner.n_vocab
        vocab = self.runner.grammar_vocab()
        self.scratch.whole_vocabulary(np, n_vocab)
        if n_vocab > 2 * SHORTLIST:
            ids = np.sort(np.argpartition(row, n_vocab - SHORTLIST)[n_vocab - SHORTLIST:])  # in ID order, as all are
            self.shape.vocab_cost(self.state, vocab, ids)  # GrammarLimit before llama.cpp is asked
            allowed = self._apply_grammar(ids, row[ids])
            if allowed is not None and self._shortlist_suffices(np.sort(allowed)[::-1], float(row[ids].min())):
                return self._draw()
        self.shape.vocab_cost(self.state, vocab)
        if self._apply_grammar(self.scratch.token_ids, row) is None:
            return -1
        return self._draw()

    def _apply_grammar(self, ids: Any, logits: Any) -> Any:
        """Load (ids, logits) as the candidates and apply the job's grammar: the logits of
        the tokens it allows, or None if it allows none."""
        np, scratch = self.runner.np, self.scratch
        candidates, array = scratch.candidates, scratch.candidates_array
        count = len(ids)
        candidates["id"][:count] = ids
        candidates["logit"][:count] = logits
        candidates["p"][:count] = 0.0
        array.size, array.selected, array.sorted = count, -1, False
        self.L.llama_sampler_apply(self.grammar, scratch.byref(array))
        kept = candidates["logit"][:count]
        kept[self.runner.control_mask[candidates["id"][:count]]] = -_INF  # see _allowed
        allowed = kept[np.isfinite(kept)]
        return allowed if len(allowed) else None

    def _draw(self) -> int:
        """The job's sampler chain on the loaded candidates: the token it draws (-1: none)."""
        scratch = self.scratch
        array = scratch.candidates_array
        self.L.llama_sampler_apply(self.chain, scratch.byref(array))
        if not 0 <= array.selected < array.size:
            return -1
        token = int(scratch.candidates["id"][array.selected])
        return token if self._allowed(token) else -1

    def _shortlist_suffices(self, allowed: Any, threshold: float) -> bool:
        """Whether the chain (top_k, top_p, min_p, temperature, dist: see LlamaRunner.sampler)
        draws from the same tokens, with the same probabilities, given only the allowed tokens
        of the shortlist (``allowed``: their logits, likeliest first) as given all of them;
        every token outside has a logit of at most ``threshold``.

        Greedy: the best allowed token is in the shortlist. top_k: if the shortlist holds
        top_k allowed tokens, they are the top_k of all. Otherwise min_p must drop every token
        outside (its cut, best + log(min_p), above ``threshold``), and top_p's nucleus must end
        at the same token of the shortlist whatever the probability those tokens add before
        min_p drops them (at most one per place top_k leaves, each at most exp(threshold))."""
        np = self.runner.np
        greedy, top_k, top_p, min_p = self.chain_settings
        best = float(allowed[0])
        if greedy:
            return best > threshold
        count = len(allowed)
        if top_k > 0 and count >= top_k:
            return True
        if min_p <= 0 or not threshold < best + math.log(min_p):
            return False
        if top_p >= 1.0:
            return True
        weights = np.exp(allowed.astype(np.float64) - best)
        cumulative = np.cumsum(weights)
        total = cumulative[-1]
        outside = ((top_k - count) if top_k > 0 else self.runner.n_vocab - count) * math.exp(threshold - best)
        fewest = int(np.searchsorted(cumulative, top_p * total * (1 - 1e-5)))  # nucleus with nothing outside
        most = int(np.searchsorted(cumulative, top_p * (total + outside) * (1 + 1e-5)))  # with all of it
        return min(most, count - 1) == fewest

    def _log_softmax(self, row: Any) -> Any:
        """The log-probability of every token, from one output row of raw logits."""
        np = self.runner.np
        logprobs = row.astype(np.float64)
        logprobs -= logprobs.max()
        logprobs -= np.log(np.exp(logprobs).sum())
        return logprobs

    def _logprob(self, logprobs: Any, token: int) -> tuple[int, float, list[tuple[int, float]]]:
        """(token, its logprob, the ``top_logprobs`` likeliest tokens with theirs, likeliest first)."""
        best: list[tuple[int, float]] = []
        top = self.top_logprobs
        if top:
            np = self.runner.np
            ids = np.argpartition(logprobs, -top)[-top:]
            ids = ids[np.lexsort((ids, -logprobs[ids]))]  # by logprob, then by token ID
            best = [(int(i), float(logprobs[i])) for i in ids]
        return token, float(logprobs[token]), best

    def logprob_content(self, text: str, stopped: bool) -> Optional[list[dict[str, Any]]]:
        """The job's log-probabilities in OpenAI's shape, for the tokens that made ``text``
        (with ``stopped``, a job with stop strings: one may have cut the tokens after it)."""
        if self.logprobs is None:
            return None
        piece, limit, used = self.runner.piece, len(text.encode("utf-8")), 0
        content = []
        for token, logprob, best in self.logprobs:
            if stopped and used >= limit:
                break
            data = piece(token)
            used += len(data)
            content.append(dict(_token_entry(data, logprob), top_logprobs=[_token_entry(piece(t), lp) for t, lp in best]))
        return content


# ============================================================================
# 11.4 Sequences and choices
# ============================================================================
# _Sequence: one job's place in a context (its cells; cached, pending and pos, set by
# _Sequence.at alone); _Choices: a job's n choices, admitted and ended together; _ThinkRouter: a
# sequence's thinking kept apart from its answer. One worker's.


class _ThinkRouter:
    """One sequence's generated text split into its thinking and its answer, by the thinking
    block's tags (``open``, ``close``: ``<think>``, ``</think>``), matched in the decoded text so
    that a tag split over tokens, or merged with its neighbours, matches alike.

    ``route(text)`` takes each decoded piece and returns the part of it that is answer; the
    rest is kept in ``parts`` (the reasoning). A piece that may be the start of a tag is held
    back until the next settles it, as stop strings are, so no tag ever reaches the answer.
    States: BEFORE (the model may open a block: leading whitespace, then the open tag or the
    answer), INSIDE (thinking, until the close tag), AFTER (closed: the whitespace before the
    answer is dropped, and a stray second close tag with it; an open tag starts another block),
    ANSWER (an open tag here starts a block again; a lone close tag is dropped). An open tag
    inside a block is dropped, so neither part holds a tag. ``headers`` (harmony's final
    channel header) are dropped before the answer as whitespace is. ``finish()`` returns what
    is still held.

    The budget: the daemon closes a block itself (writes ``closing``, the close tag's tokens
    and a separator, one a step in place of a draw: ``forced``) once ``spent`` reaches ``cap``
    (the job's budget), once ``force_at`` tokens are generated (leaving the answer its share of
    max_tokens), or when the model ends its generation inside the block (``close_now("eog")``).

    Threads: its sequence's worker only."""

    BEFORE, INSIDE, AFTER, ANSWER = range(4)
    __slots__ = ("open", "close", "state", "held", "parts", "opened", "start", "cap", "force_at", "closing",
                 "forcing", "spent", "closed", "headers", "wrote", "mark")

    def __init__(self, open: str, close: str, state: int, cap: Optional[int] = None, force_at: Optional[int] = None,
                 closing: tuple[int, ...] = (), headers: tuple[str, ...] = ()) -> None:
        self.open, self.close, self.state = open, close, state
        self.headers = headers  # markup dropped before the answer (harmony's final channel header)
        # The character every tag starts with, where they share one: text without it holds no tag
        # (route's fast path: most pieces are plain words).
        firsts = {tag[0] for tag in (open, close, *headers)}
        self.mark = firsts.pop() if len(firsts) == 1 else None
        self.held = ""
        self.parts: list[str] = []
        self.opened = state == self.INSIDE  # a block was opened (by the prompt or the model)
        self.start = state
        self.cap = cap  # the most tokens the block may hold (the job's budget), or None
        self.force_at = force_at  # generated tokens at which an open block is closed for the answer, or None
        self.closing = closing  # the tokens that close a block: close tag and separator
        self.forcing: list[int] = []  # those still to write, the next last
        self.spent = 0  # tokens generated inside a block
        self.closed: Optional[str] = None  # why the daemon closed it: budget, share, eog or model
        self.wrote = False  # the daemon wrote this step's token (forced)

    def again(self) -> "_ThinkRouter":
        """A router for another choice of the same prompt, as this one started."""
        return _ThinkRouter(self.open, self.close, self.start, self.cap, self.force_at, self.closing, self.headers)

    def forced(self, generated: int) -> int:
        """The token the daemon writes next instead of a draw, or -1: the rest of a close it has
        begun, or the first of one when the block reaches its budget, or ``generated`` tokens
        reach the point that leaves the answer its share."""
        if self.forcing:
            self.wrote = True
            return self.forcing.pop()
        if self.state != self.INSIDE or not self.closing:
            return -1
        if self.cap is not None and self.spent >= self.cap:
            return self.close_now("budget")
        if self.force_at is not None and generated >= self.force_at:
            return self.close_now("share")
        return -1

    def close_now(self, why: str) -> int:
        """The daemon closes the block (``why``: budget, share, eog, model): the first of its tokens."""
        self.closed, self.wrote = why, True
        self.forcing = list(reversed(self.closing))
        return self.forcing.pop()

    def spills(self, piece: bytes) -> bool:
        """Whether ``piece`` would close the block and carry answer text with it (``>{``): with a
        grammar, that text would skip the grammar, so the daemon closes the block instead."""
        text = self.held + piece.decode("utf-8", "ignore")
        at = text.find(self.close)
        return at >= 0 and bool(text[at + len(self.close):].strip())

    @property
    def reasoning(self) -> str:
        return "".join(self.parts).strip()

    def route(self, text: str) -> str:
        if not self.held and self.mark is not None and self.mark not in text:
            if self.state == self.ANSWER:
                return text
            if self.state == self.INSIDE:
                self.parts.append(text)
                return ""
        held, answer = self.held + text, []
        while held:
            if self.state == self.BEFORE or self.state == self.AFTER:
                held = held.lstrip()
                tags = (self.open, self.close, *self.headers) if self.state == self.AFTER else (self.open, *self.headers)
                tag = next((tag for tag in tags if held.startswith(tag)), None)
                if tag is not None:  # a block opens; or a header, or a second close tag, dropped
                    held = held[len(tag):]
                    if tag == self.open:
                        self.state, self.opened = self.INSIDE, True
                    continue
                if any(tag.startswith(held) for tag in tags):  # may still become one
                    break
                self.state = self.ANSWER
            else:  # INSIDE: the text up to a tag is reasoning; ANSWER: answer
                before, tag, held = self._cut(held)
                (self.parts if self.state == self.INSIDE else answer).append(before)
                if tag is None:
                    break
                if self.state == self.INSIDE and tag == self.close:  # an open tag inside the block is dropped
                    self.state = self.AFTER
                elif self.state == self.ANSWER and tag == self.open:  # a lone close tag is dropped
                    self.state, self.opened = self.INSIDE, True
        self.held = held
        return "".join(answer)

    def _cut(self, held: str) -> tuple[str, Optional[str], str]:
        """``held``'s text before its first tag, that tag, and the text after it; with no tag:
        the text, None, and the end that may still start one (held back)."""
        found = [(held.find(tag), tag) for tag in (self.open, self.close) if tag in held]
        if not found:
            keep = len(held) - _tag_start(held, (self.open, self.close))
            return held[:keep], None, held[keep:]
        at, tag = min(found)
        return held[:at], tag, held[at + len(tag):]

    def finish(self) -> str:
        """What is still held: reasoning inside an unclosed block, else answer text."""
        held, self.held = self.held, ""
        if self.state == self.INSIDE:
            self.parts.append(held)
            return ""
        return held.lstrip() if self.state != self.ANSWER else held


def _tag_start(text: str, tags: Iterable[str]) -> int:
    """How many of ``text``'s last characters may be the start of one of ``tags``."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


class _Thinking:
    """A thinking model's block, found in its chat template (``find``): its tags, and the tokens
    the daemon writes: ``closing`` closes a block (close tag and a blank line, or harmony's
    ``<|end|>`` and final header), ``opening`` opens one, ``skip`` goes straight to the answer.
    ``start`` gives each job its prompt and the router of its thinking.

    Threads: made by the model's loader; read only after (every worker's sequences start here)."""

    __slots__ = ("runner", "tags", "headers", "closing", "opening", "skip")

    def __init__(self, runner: "LlamaRunner", tags: tuple[str, str], headers: tuple[str, ...]) -> None:
        self.runner, self.tags, self.headers = runner, tags, headers
        closing = tags[1] + ("".join(headers) or THINK_SEPARATOR)
        opening = tags[0] + ("" if headers else "\n")
        for text in (closing, opening):  # a control token (rendered empty) is given its text
            for token in runner.tokenize(text, add_special=False, special=True):
                if not runner.piece(token):
                    runner.give_text(token)
        self.closing = tuple(runner.tokenize(closing, add_special=False, special=True))
        self.opening = runner.tokenize(opening, add_special=False, special=True)
        self.skip = runner.tokenize(headers[-1] if headers else opening + closing, add_special=False, special=True)

    @classmethod
    def find(cls, runner: "LlamaRunner", template: str, setting: str) -> Optional["_Thinking"]:
        """NRVNA_THINKING_TAGS's pair; with ``auto``, harmony's when the chat template writes
        channels (gpt-oss), else the first of THINK_TAGS whose close tag it holds; None when the
        model does not think (or ``off``)."""
        pair, headers = thinking_tags(setting), ()
        if pair is None and setting == "auto":
            if "<|channel|>" in template and "<|message|>" in template:
                pair, headers = HARMONY_TAGS, HARMONY_HEADERS
            else:
                pair = next((tags for tags in THINK_TAGS if tags[1] in template), None)
        return None if pair is None else cls(runner, pair, headers)

    def start(self, prompt: list[int], params: Mapping[str, Any], max_tokens: int, room: int
              ) -> tuple[list[int], _ThinkRouter]:
        """A job's prompt and the router of its thinking.

        Where the prompt stands: inside a block when its rendering opened one (DeepSeek-R1,
        Qwen3.5), past it when the rendering closed it (enable_thinking false), else before it
        (Qwen3: the model may open one). A job with a grammar has its block opened in the
        prompt, as llama.cpp does, so that it thinks before the grammar starts; a job that may
        not think (budget 0), or whose max_tokens leaves no room to think and answer, goes to
        the answer in the prompt. The answer keeps a quarter of the tokens the job may generate
        (max_tokens, or fewer where the sequence's ``room`` holds fewer): the block is closed
        when the rest is spent."""
        open_tag, close_tag = self.tags
        tail = b"".join(self.runner.piece(token) for token in prompt[-8:]).decode("utf-8", "replace").rstrip()
        answering = (close_tag, *self.headers[-1:])  # closed, or harmony's final channel opened
        # Past a block the prompt closed, the router drops the whitespace before the answer as it
        # does after a block the model closed (AFTER): the model writes a newline there (a budget
        # of 0 closes it in the template: the answer started with "\n").
        state = (_ThinkRouter.INSIDE if tail.endswith(open_tag) else
                 _ThinkRouter.AFTER if any(map(tail.endswith, answering)) else _ThinkRouter.BEFORE)
        if state == _ThinkRouter.BEFORE and not job_param(params, "raw") and self.runner.has_grammar(params):
            prompt, state = prompt + self.opening, _ThinkRouter.INSIDE
        cap = thinking_budget(params)
        generated = min(room, len(prompt) + max_tokens) - len(prompt)
        force_at = generated - (generated + 3) // 4 - len(self.closing)
        if state in (_ThinkRouter.BEFORE, _ThinkRouter.INSIDE) and (cap == 0 or force_at <= 0):  # no thinking: the answer now
            prompt = prompt + (list(self.closing) if state == _ThinkRouter.INSIDE else self.skip)
            state = _ThinkRouter.AFTER
        return prompt, _ThinkRouter(open_tag, close_tag, state, cap, force_at, self.closing, self.headers)


class _Choices:
    """A job's n > 1 choices in one context: its prompt computed once by the first sequence,
    whose cells the others copy; each choice its own sequence, sampler and seed. Choices start
    as the room allows (``admit``); the job ends when every choice has, or with the first that
    fails (``end``).

    Threads: its session's worker thread only; it changes its session's slots through the
    session's own methods (``room``, ``sampler``, ``release``) and its _PrefixCache."""

    __slots__ = ("n", "started", "ended", "results")

    def __init__(self, n: int) -> None:
        self.n = n
        self.started = 1  # the first choice starts with the job
        self.ended = False
        self.results: list[Optional[Outcome]] = [None] * n

    @staticmethod
    def waiting(slots: list[Optional[_Sequence]]) -> list[_Sequence]:
        """A sequence of each job whose further choices wait for room (not one in the kept room)."""
        jobs = {id(s.choices): s for s in slots if s is not None and s.choices is not None and not s.reserved
                and not s.choices.ended and s.choices.started < s.choices.n}
        return list(jobs.values())

    @classmethod
    def begin(cls, session: "LlamaSession", first: _Sequence, n: int) -> None:
        """``first``'s job asks for ``n`` choices: start as many more as the room allows; if
        one cannot start, none of the job's choices stays behind (the job fails at start)."""
        first.choices = cls(n)
        try:
            first.choices.admit(session, first)
        except BaseException:
            for other in session.slots:
                if other is not None and other.job is first.job:
                    session.release(other, keep=False)
            raise

    def admit(self, session: "LlamaSession", first: _Sequence) -> None:
        """Start more of ``first``'s job's choices in free slots, as many as the room allows (none
        in the room kept for a job above the others: its choices run one after another)."""
        while self.started < self.n and not first.reserved:
            running, room = session.room()
            if running >= session.seqs or room < first.budget:
                return
            self._start(session, first, session.prefixes.spare_slot(session.slots), self._sampler(session, first))

    def _sampler(self, session: "LlamaSession", first: _Sequence) -> _JobSampler:
        """The sampler of ``first``'s job's next choice (seeded seed + its index)."""
        return session.sampler(_choice_params(first.job.params, self.started, session.runner.config))

    def _start(self, session: "LlamaSession", first: _Sequence, slot: int, sampler: _JobSampler,
               own_cells: bool = False) -> None:
        """The next choice of ``first``'s job, in ``slot``: over the prompt's cells a choice
        computed (see _PrefixCache._attach_choice), or with ``own_cells`` those ``slot`` holds
        (a choice of the job has just ended there)."""
        seq = session.slots[slot] = _Sequence(first.job, slot, first.prompt, first.max_tokens, first.budget, sampler)
        seq.think_with(first.think.again() if first.think is not None else None)
        seq.reserved, seq.choices, seq.choice, seq.tools, seq.stops = first.reserved, self, self.started, first.tools, first.stops
        self.started += 1
        if not (own_cells and session.prefixes.keep_choice(seq)):
            session.prefixes.attach(seq, session.slots)

    def end(self, session: "LlamaSession", seq: _Sequence, outcome: Outcome, error: Optional[tuple[str, str]],
            keep: bool) -> Optional[Outcome]:
        """``seq``, one of the choices, has ended with ``outcome`` (``error``): the job's outcome
        once the job ends, else None (the next choice has started in its slot, or the slot is
        free). The first choice to fail ends the job and every other choice."""
        if self.ended:  # the job already ended (another choice failed)
            session.release(seq, keep=False)
            return None
        for other in session.slots:  # choices waiting for the prompt's cells copy them before they go
            if other is not None and other.choices is self and other.waiting:
                session.prefixes.attach(other, session.slots)
        self.results[seq.choice] = outcome
        if error is None and self.started < self.n:
            try:
                sampler = self._sampler(session, seq)
            except JobError as err:  # the job fails: nothing has changed yet
                error = (err.code, str(err))
            else:
                seq.sampler.free()
                self._start(session, seq, seq.slot, sampler, own_cells=True)
                return None
        if error is None and any(r is None for r in self.results):
            session.release(seq, keep and not seq.reserved)
            return None
        self.ended = True
        siblings = [s for s in session.slots if s is not None and s is not seq and s.choices is self]
        outcome = self.outcome() if error is None else self.failure(error, seq.n_prompt, siblings)
        for other in siblings:  # the first failure fails the job
            session.release(other, keep=False)
        session.release(seq, keep and not seq.reserved)
        return outcome

    def outcome(self) -> Outcome:
        """The job's result, once every choice has one."""
        first = self.results[0]
        choices = []
        for i, result in enumerate(self.results):
            choice = {"index": i, "text": result.text, "finish_reason": result.finish_reason,
                      "generated_tokens": result.generated_tokens}
            if result.logprobs is not None:
                choice["logprobs"] = result.logprobs
            if result.message is not None:  # its calls, and as result.txt would hold them
                choice.update(text=call_lines(result.message["tool_calls"]), **result.message)
            if result.reasoning is not None:  # a thinking model's: each choice thought on its own
                choice["reasoning"], choice["reasoning_tokens"] = result.reasoning, result.reasoning_tokens
                if result.thinking_closed is not None:
                    choice["thinking_closed"] = result.thinking_closed
            choices.append(choice)
        return first._replace(generated_tokens=sum(r.generated_tokens for r in self.results), choices=choices,
                              prompt_computed=sum(r.prompt_computed or 0 for r in self.results),
                              reasoning_tokens=sum(r.reasoning_tokens for r in self.results))

    def failure(self, error: tuple[str, str], prompt_tokens: int, running: list["_Sequence"]) -> Outcome:
        """The job's failure at its first failing choice: that choice's code and message, the
        first choice's text (partial.txt has followed it) and every choice's tokens so far."""
        first = self.results[0] or next(s.outcome("stop", None) for s in running if s.choice == 0)
        ended = [r for r in self.results if r is not None]
        generated = sum(r.generated_tokens for r in ended) + sum(s.n_gen for s in running)
        computed = sum(r.prompt_computed or 0 for r in ended) + sum(s.computed for s in running)
        return Outcome(first.text, "error", prompt_tokens, generated, error[0], error[1], first.logprobs,
                       prompt_computed=computed, reasoning=first.reasoning, reasoning_tokens=first.reasoning_tokens)


def _choice_params(params: dict[str, Any], choice: int, config: Config) -> dict[str, Any]:
    """Choice ``choice``'s parameters: seeded seed + choice (0, random, stays random)."""
    seed = job_param(params, "seed", config)
    if not choice or not seed:
        return params
    return {**params, "seed": (seed - 1 + choice) % 0xFFFFFFFE + 1}


class _Sequence:
    """One job generating in a slot of a context: its prompt and KV cells, its sampler, and
    the text its tokens make (cut at a stop string, passed on for partial.txt). Its place in
    the prompt (``cached``, ``pending``, ``pos``) changes only through its own methods: ``at``
    when its cells are (re)attached, ``feed_last``/``feed_chunk``/``unfeed_last`` as a step
    fills the batch.

    Threads: its session's worker thread only (made, stepped and ended there)."""

    __slots__ = ("job", "slot", "prompt", "pending", "pos", "n_prompt", "n_gen", "max_tokens", "sampler",
                 "decoder", "parts", "last", "ignore_eos", "stops", "tail", "cached", "waiting", "unsent",
                 "budget", "priority", "reserved", "choices", "choice", "computed", "think", "thought", "from_disk",
                 "tools")

    def __init__(self, job: RunningJob, slot: int, tokens: list[int], max_tokens: int, budget: int,
                 sampler: _JobSampler) -> None:
        self.job = job
        self.slot = slot
        self.budget = budget  # KV cells this job can come to hold: its prompt and max_tokens
        self.prompt = tokens
        self.cached: list[int] = []  # tokens whose KV cells this slot holds, in order
        self.pending = tokens  # prompt tokens not yet decoded (see at)
        self.pos = 0  # the position of the next token decoded: len(cached)
        self.waiting = False  # for a batch-mate to compute a prefix this prompt shares
        self.n_prompt = len(tokens)
        self.n_gen = 0
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # pieces split UTF-8
        self.parts: list[str] = []
        self.last = -1
        self.ignore_eos = job_param(job.params, "ignore_eos")
        self.stops: list[str] = list(job_param(job.params, "stop") or [])
        self.tail = ""
        self.unsent = ""  # generated text held back from partial.txt (see _emit)
        self.priority = job_param(job.params, "priority")
        self.reserved = False  # runs in the room kept for a job above every other (see LlamaSession)
        self.choices: Optional[_Choices] = None  # a job of n > 1 choices: its other sequences' too
        self.choice = 0  # which of them
        self.computed = 0  # prompt tokens decoded for it (the rest were cells shared with others)
        self.think: Optional[_ThinkRouter] = None  # a thinking model's: its thinking kept apart
        self.thought = 0  # tokens generated before its answer (reasoning_tokens)
        self.from_disk = 0  # prompt tokens whose cells a saved state gave (StateStore)
        self.tools: Optional[ToolFormat] = None  # a job that may call tools: how its calls are written

    def think_with(self, router: Optional[_ThinkRouter]) -> None:
        """A thinking model's sequence: ``router`` keeps its thinking apart (and its sampler
        free of the job's grammar and log-probabilities while it thinks)."""
        self.think = router
        self.sampler.thinking = router is not None and router.state == _ThinkRouter.INSIDE

    def at(self, computed: int) -> None:
        """Its slot holds the KV cells of its prompt's first ``computed`` tokens (kept, copied
        or none): the rest of the prompt is decoded from there."""
        self.cached, self.pending, self.pos = self.prompt[:computed], self.prompt[computed:], computed

    def feed_last(self) -> int:
        """Its last token goes into this step's batch: the position it is decoded at."""
        self.cached.append(self.last)
        self.pos += 1
        return self.pos - 1

    def feed_chunk(self, most: int) -> tuple[list[int], int]:
        """At most ``most`` of its prompt tokens not yet decoded go into this step's batch:
        them, and the position of the first."""
        take, first = min(len(self.pending), most), self.pos
        chunk, self.pending = self.pending[:take], self.pending[take:]
        self.cached.extend(chunk)
        self.computed += take
        self.pos += take
        return chunk, first

    def unfeed_last(self) -> None:
        """The step that fed its last token was cut short: llama.cpp dropped that cell."""
        self.cached.pop()
        self.pos -= 1

    def add(self, token: int, piece: bytes) -> bool:
        """``token`` (its bytes ``piece``) was generated: its text is kept and passed on.
        True if it completed a stop string (the text is cut where the stop string starts)."""
        self.n_gen += 1
        self.last = token
        text = self.decoder.decode(piece)
        think = self.think
        if think is not None:
            before = think.state
            text = think.route(text)
            if before != _ThinkRouter.ANSWER or think.state != _ThinkRouter.ANSWER:  # (an answer's token: no more)
                think.spent += before == _ThinkRouter.INSIDE
                if not text:  # not the answer's: no log-probability
                    self.sampler.unlog()
                    # The block's tokens are its reasoning tokens: its tags, its thinking, and what the
                    # daemon wrote to close it (not the whitespace the model writes after a close).
                    self.thought += before != _ThinkRouter.AFTER or think.wrote
                self.sampler.thinking = think.state == _ThinkRouter.INSIDE
            think.wrote = False
        if text:
            self.parts.append(text)
            if self.stops and self._hit_stop(text):
                return True
            self._emit(text)
        return False

    def _emit(self, text: str) -> None:
        """Pass new text on for partial.txt, holding back what could still become the start
        of a stop string (so partial.txt is always a prefix of the final result). Only the
        first choice's text goes there (result.txt's)."""
        if self.choice or self.tools is not None:  # a call's text is not its result (result.txt: the calls)
            return
        if not self.stops:
            self.job.emit(text)
            return
        self.unsent += text
        keep = max(len(s) for s in self.stops) - 1
        if len(self.unsent) > keep:
            cut = len(self.unsent) - keep
            self.job.emit(self.unsent[:cut])
            self.unsent = self.unsent[cut:]

    def _hit_stop(self, text: str) -> bool:
        longest = max(len(s) for s in self.stops)
        self.tail = (self.tail + text)[-(longest + len(text)):]
        if not any(s in self.tail for s in self.stops):
            return False
        full = "".join(self.parts)
        cut = min(i for i in (full.find(s) for s in self.stops) if i >= 0)
        self.parts = [full[:cut]]
        return True

    def outcome(self, reason: str, error: Optional[tuple[str, str]]) -> Outcome:
        """The job's result: its text (flushing the decoder unless a stop string ended it),
        with ``reason``, or the ``error`` (code, message)."""
        text = "".join(self.parts)
        if not self.stops or reason != "stop":
            rest = self.decoder.decode(b"", final=True)
            text += rest if self.think is None else self.think.route(rest)
        reasoning = closed = None
        if self.think is not None:
            text += self.think.finish() if not (self.stops and reason == "stop") else ""
            reasoning, closed = self.think.reasoning, self.think.closed
        logprobs = self.sampler.logprob_content(text, bool(self.stops))
        reused = {"memory": max(0, self.n_prompt - self.computed - self.from_disk), "disk": self.from_disk}
        message = None
        calls = read_tool_calls(text, self.tools, self.job.id, self.choice) if self.tools and not error else None
        if calls is not None and calls[1]:  # (cut by max_tokens: the whole calls, and "length" stays)
            message, reason = {"content": calls[0], "tool_calls": calls[1]}, "tool_calls" if reason == "stop" else reason
        elif calls is not None:  # the generic form's answer in words
            text = calls[0] or ""
        if error:
            return Outcome(text, "error", self.n_prompt, self.n_gen, error[0], error[1], logprobs,
                           prompt_computed=self.computed, reasoning=reasoning, reasoning_tokens=self.thought,
                           thinking_closed=closed, prompt_reused=reused)
        return Outcome(text, reason, self.n_prompt, self.n_gen, logprobs=logprobs, prompt_computed=self.computed,
                       reasoning=reasoning, reasoning_tokens=self.thought, thinking_closed=closed, prompt_reused=reused,
                       message=message)


# ============================================================================
# 11.5 Embeddings
# ============================================================================
# _Embedder: a worker's embedding context, packing texts into decodes of EMBED_PACK tokens and
# pooling their vectors. One worker's.


# A float32 as the shortest text that reads back as the same float32 (9 digits suffice).
_FLOAT32_TEXT = "{:.9g}".format


class _Embedding:
    """One embed job in a worker's embedding context: its texts as tokens, and a vector
    line for each text embedded so far.

    Threads: its _Embedder's worker thread only."""

    __slots__ = ("job", "tokens", "lines", "next", "done", "dimensions")

    def __init__(self, job: RunningJob, tokens: list[list[int]], dimensions: Optional[int]) -> None:
        self.job = job
        self.tokens = tokens
        self.lines: list[str] = [""] * len(tokens)
        self.next = 0  # the first text not yet in a decode
        self.done = 0
        self.dimensions = dimensions


class _Embedder:
    """A worker's embedding context: the model's pooled vectors, many texts per decode.

    A context of its own (``embeddings`` on, the runner's pooling), made when the worker's
    first embed job arrives, never shared between threads. Each decode packs texts of the
    queued embed jobs, in order, as sequences of their own (up to EMBED_SEQS texts and
    ``pack`` tokens; one longer text alone, up to ``limit``). A text must fit one micro-batch: a non-causal
    model (BERT) attends over the whole text at once, so the micro-batch is as large as the
    longest text allowed (``limit``); a longer text fails its job alone (context_overflow).

    Threads: its session's worker thread only (its decodes go through the session's
    ``_decode``: on the runner's Wide thread when the worker has borrowed threads).
    """

    def __init__(self, runner: LlamaRunner, threads: int, limit: int, pack: int) -> None:
        L = self.L = runner.L
        self.runner = runner
        self.limit = limit
        self.pack = pack
        size = max(limit, pack)  # a decode holds a pack of texts, or one text up to the limit
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = size
        params.n_seq_max = EMBED_SEQS
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = POOLING_CODES.index(runner.pooling)
        params.kv_unified = True  # else each sequence gets pack / EMBED_SEQS cells
        # Flash attention over a causal model's KV cache makes a text's vector depend on its
        # batch-mates (cosine 0.99988 to the same text alone, measured on SmolLM2; 0.99997
        # without it). An encoder (BERT) has no KV cache: there it changed vectors by less than
        # 1e-6 and embedded 1.5 times as fast, so llama.cpp's default (auto: on) stays.
        if runner.causal:
            params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self.ctx, self.buffers = _new_context(L, runner.model, params)
        if not self.ctx:
            raise JobError("model_error", f"cannot create an embedding context of {size} tokens (out of memory? "
                                          "lower NRVNA_MAX_CTX)")
        self.memory = L.llama_get_memory(self.ctx)  # None for models without a KV cache (BERT)
        self.batch = L.llama_batch_init(size, 0, 1)
        self.normalize = bool(runner.config.embed_normalize)
        self.jobs: list[_Embedding] = []

    def start(self, job: RunningJob) -> None:
        """Queue ``job``'s texts; raise JobError if one cannot be embedded here."""
        texts = job_param(job.params, "input") or [job.prompt]
        tokens = [self.runner.tokenize(text, add_special=True, special=False) for text in texts]
        for i, row in enumerate(tokens):
            which = "the text" if len(texts) == 1 else f"input[{i}]"
            if len(row) > self.limit:
                raise JobError("context_overflow", f"{which} is {len(row)} tokens; an embedding takes at most "
                                                   f"{self.limit} (the model's context, or NRVNA_MAX_CTX / 8)")
            if not row:
                raise JobError("bad_request", f"{which} has no tokens")
        dimensions = job_param(job.params, "dimensions")
        if dimensions is not None and dimensions > self.runner.n_embd:
            raise JobError("bad_request", f"dimensions={dimensions}, but the model's vectors have "
                                          f"{self.runner.n_embd}")
        self.jobs.append(_Embedding(job, tokens, dimensions))

    def step(self, decode: Callable[[Any, Any], int]) -> list[tuple[RunningJob, Outcome]]:
        """Embed the next texts in one decode; return the jobs whose texts are all done."""
        ended = [self._end(e, e.job.interrupt) for e in list(self.jobs) if e.job.interrupt is not None]
        L, batch = self.L, self.batch
        placed: list[tuple[_Embedding, int]] = []
        n = 0
        for entry in self.jobs:
            while entry.next < len(entry.tokens) and len(placed) < EMBED_SEQS:
                row = entry.tokens[entry.next]
                if n and n + len(row) > self.pack:
                    break
                for pos, token in enumerate(row):
                    batch.token[n] = token
                    batch.pos[n] = pos
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = len(placed)
                    batch.logits[n] = 1  # embeddings read every token's output
                    n += 1
                placed.append((entry, entry.next))
                entry.next += 1
            if entry.next < len(entry.tokens):
                break  # the decode is full: keep the jobs' order
        if not placed:
            return ended
        batch.n_tokens = n
        code = decode(self.ctx, batch)
        if self.memory:
            L.llama_memory_clear(self.memory, True)  # every decode starts afresh
        if code != 0:
            message = {1: "no room left in the KV cache", 2: "decode aborted"}.get(code, f"llama_decode returned {code}")
            failed = {id(entry): entry for entry, _ in placed}
            return ended + [self._end(entry, ("model_error", message)) for entry in failed.values()]
        np, size = self.runner.np, self.runner.n_embd
        for seq, (entry, index) in enumerate(placed):
            pointer = L.llama_get_embeddings_seq(self.ctx, seq)
            if not pointer:
                return ended + [self._end(e, ("model_error", "llama.cpp returned no embedding")) for e in list(self.jobs)]
            vector = np.ctypeslib.as_array(pointer, shape=(size,))[:entry.dimensions or size].astype(np.float64)
            if not np.isfinite(vector).all():
                ended.append(self._end(entry, ("model_error", "the model's embedding holds NaN or infinity")))
                continue
            if self.normalize:
                norm = math.sqrt(float(vector @ vector))
                vector = vector / norm if norm > 0 else vector
            entry.lines[index] = "[" + ",".join(map(_FLOAT32_TEXT, vector.astype(np.float32).tolist())) + "]\n"
            entry.done += 1
        return ended + [self._end(entry) for entry in list(self.jobs) if entry.done == len(entry.tokens)]

    def _end(self, entry: _Embedding, error: Optional[tuple[str, str]] = None) -> tuple[RunningJob, Outcome]:
        if entry in self.jobs:
            self.jobs.remove(entry)
        tokens = sum(len(row) for row in entry.tokens)
        if error is not None:
            return entry.job, Outcome("", "error", tokens, 0, error[0], error[1])
        return entry.job, Outcome("".join(entry.lines), "stop", tokens, 0)

    def drop(self, job: RunningJob) -> None:
        """Forget ``job`` (handed back to the queue)."""
        self.jobs = [e for e in self.jobs if e.job is not job]

    def close(self) -> None:
        """Free the context and its batch."""
        self.jobs.clear()
        if self.ctx:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None


# ============================================================================
# 11.6 Saved states: computed contexts kept on disk
# ============================================================================
# StateStore: a model's KV states saved when a job ends (the tokens it covers and its fingerprint:
# what makes its numbers valid) and restored for any later job whose tokens begin with them, in
# this daemon or a later one. Files per §7.7; written by the Saver thread; bounded by NRVNA_CACHE_DISK.


RESTORE_GAIN_TOKENS = 64  # a saved state is read only when it covers this many tokens more than memory
SAVES_PENDING = 2  # states waiting to be written with NRVNA_CACHE_PENDING=auto: each is at most a job's share of cells
STALE_TEMP_SECONDS = 600.0  # a temporary state file this old is a dead writer's


def state_fingerprint(runner: Any, model_path: str) -> str:
    """What makes a saved state's numbers valid, as one string: the model file (its size and the
    sha256 of its first and last MiB: the header, the vocabulary, the last tensors; not the
    path), llama-cpp-python's version and state format, and the context's KV layout (types,
    flash attention's V layout, one stream, layers, GPU offload). llama.cpp checks none of the
    model's identity when it restores: this is what does."""
    import hashlib
    import json

    L = runner.L
    digest = hashlib.sha256()
    with open(model_path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    version = getattr(sys.modules.get("llama_cpp"), "__version__", "?")
    return json.dumps({"model": [size, digest.hexdigest()[:32]], "llama_cpp": version,
                       "state": getattr(L, "LLAMA_STATE_SEQ_VERSION", None),
                       "kv": [*_kv_params(L, runner.config), "unified"],
                       "layers": L.llama_model_n_layer(runner.model), "gpu_layers": runner.config.gpu_layers},
                      sort_keys=True, separators=(",", ":"))


def _shared_prefix(a: Any, b: Any) -> int:
    """How many leading tokens two arrays share: slices compared in C, halving the range (an
    8,000-token state is compared in about 14 slice comparisons, not 8,000 steps)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class _CheckThread:
    """A mapped state's crc checked on a thread of its own (see StateStore.restore).

    Threads: made and joined (``result``) by one worker; the checking thread reads the mapping
    only, which the worker closes after the join."""

    def __init__(self, mapped: Any) -> None:
        self._whole = False
        self._thread = threading.Thread(target=self._check, args=(mapped,), name="StateCheck", daemon=True)
        self._thread.start()

    def _check(self, mapped: Any) -> None:
        self._whole = state_whole(mapped)

    def result(self) -> bool:
        self._thread.join()
        return self._whole


class StateStore:
    """A model's saved KV states: which exist (an index of their headers, read again when the
    folder changes: another daemon's saves), the longest one a job's tokens begin with
    (``find``), restoring one into a sequence (``restore``), saving one (``save``: copied out
    of the context on the worker, written by the Saver thread), and the bound (``evict``).

    A state is used only under the exact fingerprint it was saved with (model file, llama.cpp's
    build and state version, KV types and layout): anything else is a miss, never a wrong hit.
    A file of nrvna's (its magic) that is torn, damaged or inconsistent (its counts, its crc, a
    state that does not hold the tokens it names) is a miss and is removed; any other file is
    read once and left alone, and a file that cannot be read now is a miss, never removed. The
    bound counts and evicts the states of this store's owner only (its workspace's; see
    state_owner), and those saved before owners were recorded.

    Threads: Worker-N calls find, restore, wants and save; the Saver thread (started by the
    first save) writes and evicts; the loader closes it (joins the Saver: pending saves are
    written). The index, the names skipped, the pending count and the counters are under
    ``_lock``; a file is read outside it (two threads listing at once read a new file twice).
    """

    def __init__(self, folder: str, fingerprint: str, limit: int, min_tokens: int,
                 pending_limit: Optional[int] = None, owner: str = "") -> None:
        import queue

        self.folder, self.fingerprint, self.limit, self.min_tokens = folder, fingerprint, limit, min_tokens
        self.pending_limit = pending_limit  # bytes of states copied out and not yet written; None: 2 states
        self.owner = owner  # state_owner of the workspace; "": the bound counts every state (a store made alone)
        self._lock = threading.Lock()
        self._index: dict[str, StateHead] = {}  # the folder's whole states (any fingerprint, any owner), by file name
        self._skipped: set[str] = set()  # .kv names read once and left alone (not nrvna's; damaged and not removable)
        self._listed: Optional[int] = None  # the folder's mtime when it was last listed
        self._queue: Any = queue.SimpleQueue()
        self._pending = self._waiting = 0  # bytes, and states, copied out and not yet written
        self._saver: Optional[threading.Thread] = None
        self.counts = {"saved": 0, "restored": 0, "dropped": 0, "removed": 0}
        try:
            os.makedirs(folder, DIR_MODE, exist_ok=True)
        except OSError as err:
            log.warning(f"saved states: cannot make {folder} ({_os_error(err)}); contexts are not kept on disk")
        self._clean_temporaries()
        self.evict()

    @classmethod
    def for_model(cls, runner: Any, model_path: str, owner: str = "") -> Optional["StateStore"]:
        """The store of a loaded model's states, or None where the settings turn it off
        (NRVNA_CACHE_DISK 0, NRVNA_PREFIX_CACHE 0, no folder: a runner made outside a daemon)."""
        config = runner.config
        limit = size_bytes(config.cache_disk)
        if not (limit and config.prefix_cache and config.cache_dir):
            return None
        pending = None if config.cache_pending == "auto" else size_bytes(config.cache_pending)
        return cls(config.cache_dir, state_fingerprint(runner, model_path), limit, config.cache_min_tokens, pending,
                   owner)

    def _clean_temporaries(self) -> None:
        """Remove the temporary files of saves cut short (named exactly as nrvna names them,
        STATE_TEMP; any other hidden file is left): their writer (the pid in the name) is dead,
        or they are older than any save takes (another daemon's, on another machine)."""
        now = time.time()
        with contextlib.suppress(OSError), os.scandir(self.folder) as entries:
            for entry in entries:
                temp = STATE_TEMP.fullmatch(entry.name)
                if temp is None:
                    continue
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode) and (not _process_exists(int(temp.group(1)))
                                                       or now - info.st_mtime > STALE_TEMP_SECONDS):
                        os.unlink(entry.path)

    def _refresh(self) -> None:
        """Read the headers of states saved since the folder was last listed (by any daemon)
        and forget those removed."""
        try:
            mtime = os.stat(self.folder).st_mtime_ns
        except OSError:
            return
        if mtime == self._listed:
            return
        try:
            names = {n for n in os.listdir(self.folder) if _is_state_name(n)}
        except OSError:
            return
        with self._lock:
            known = set(self._index) | self._skipped
        found = {n: inspect_state(self.folder, n) for n in names - known}
        skipped = {n for n, (_, why) in found.items() if why == "foreign"}  # not nrvna's: read once, left alone
        for name in [n for n, (_, why) in found.items() if why == "damaged"]:  # nrvna's: a .kv name is only ever whole
            try:
                os.unlink(os.path.join(self.folder, name))
                log.warning(f"saved state {name} removed: it is torn or damaged (its header's counts)")
            except FileNotFoundError:
                pass
            except OSError:
                skipped.add(name)
        with self._lock:  # an unreadable file (EMFILE, EACCES) is neither: read again at the next listing
            self._listed = mtime
            for name in known - names:
                self._index.pop(name, None)
                self._skipped.discard(name)
            self._index.update({n: h for n, (h, _) in found.items() if h is not None})
            self._skipped |= skipped

    def _heads(self) -> list[StateHead]:
        """The whole states of this store's fingerprint (the ones it may restore)."""
        with self._lock:
            return [h for h in self._index.values() if h.fingerprint == self.fingerprint]

    def find(self, tokens: list[int], usable: int, most: int, trimmable: bool) -> Optional[tuple[StateHead, int]]:
        """The saved state sharing the longest prefix with ``tokens`` (at most ``usable`` of
        them count) and at most ``most`` tokens long (the cells it needs while it is
        restored), with that length; None if none shares any. ``trimmable``: a state may be
        cut back to the shared prefix (full attention); else only a state the tokens extend
        whole is used (sliding-window, recurrent and hybrid models)."""
        from array import array

        self._refresh()
        wanted = array("i", tokens)
        best: Optional[tuple[StateHead, int]] = None
        for head in self._heads():
            if len(head.tokens) > most:
                continue
            n = min(_shared_prefix(head.tokens, wanted), usable)
            if n < len(head.tokens) and not trimmable:
                continue
            if n > (best[1] if best else 0):
                best = (head, n)
        return best

    def restore(self, L: Any, ctx: Any, slot: int, head: StateHead) -> bool:
        """Put ``head``'s state into sequence ``slot`` of ``ctx`` (what it held is replaced);
        False, the sequence emptied, if it cannot be (a damaged file is removed). The file is
        mapped, and its crc checked on another thread while llama.cpp copies it in: a state
        that fails it, or that leaves the sequence without exactly the tokens it names (a blob
        of another prompt, or none: llama.cpp's returned length proves nothing then), is taken
        out again before anything is decoded with it."""
        import ctypes

        mapped = self._map(head)
        if mapped is None:
            L.llama_memory_seq_rm(L.llama_get_memory(ctx), slot, -1, -1)
            return False
        whole = _CheckThread(mapped)
        buffer = (ctypes.c_uint8 * head.blob).from_buffer(mapped, head.size - 4 - head.blob)
        restored = L.llama_state_seq_set_data(ctx, buffer, head.blob, slot) == head.blob
        del buffer
        why = ("it is torn or damaged (its crc)" if not whole.result() else
               "its state does not hold the tokens it names" if restored and not self._holds(L, ctx, slot, head)
               else "")
        mapped.close()
        if why or not restored:
            L.llama_memory_seq_rm(L.llama_get_memory(ctx), slot, -1, -1)
        if why:
            self._remove(head, why)
            return False
        if not restored:
            log.limited("state restore", f"saved state {head.name} could not be restored (llama.cpp refused it: "
                        "no room, or a layout this context does not have); its prompt is computed", "warning")
            return False
        with contextlib.suppress(OSError):
            os.utime(os.path.join(self.folder, head.name))  # recently used: evicted last
        with self._lock:
            self.counts["restored"] += 1
        return True

    def _map(self, head: StateHead) -> Optional[Any]:
        """``head``'s file mapped, or None: gone (another daemon's bound evicted it), changed,
        or not readable now (a miss: the file is left)."""
        try:
            mapped = map_state(self.folder, head)
        except FileNotFoundError:
            mapped = None
            log.debug(f"saved state {head.name} is gone (another daemon removed it); its prompt is computed")
        except OSError as err:
            log.limited(f"state read:{err.errno}", f"saved state {head.name} could not be read ({_os_error(err)}); "
                        "its prompt is computed", "warning")
            return None
        if mapped is None:
            with self._lock:  # read again if it is listed again
                self._index.pop(head.name, None)
        return mapped

    @staticmethod
    def _holds(L: Any, ctx: Any, slot: int, head: StateHead) -> bool:
        """Whether sequence ``slot`` holds the tokens ``head`` names after a restore: its last
        position is their count less one (a sliding-window cache keeps its first positions
        only within the window: the first may be above 0)."""
        memory = L.llama_get_memory(ctx)
        last = L.llama_memory_seq_pos_max(memory, slot)
        return last == len(head.tokens) - 1 and 0 <= L.llama_memory_seq_pos_min(memory, slot) <= last

    def _remove(self, head: StateHead, why: str) -> None:
        """Remove a state file of nrvna's (its magic was read) that is damaged or inconsistent."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, head.name))
        with self._lock:
            self._index.pop(head.name, None)
            self.counts["removed"] += 1
        log.warning(f"saved state {head.name} removed: {why}")

    def wants(self, tokens: list[int], conversation: bool, computed: int) -> bool:
        """Whether a context of ``tokens`` is worth saving: long enough, not covered by a state
        already saved, and either part of a conversation (a later turn continues it) or mostly
        its own (``computed`` tokens were computed for it: a batch's lines that share a saved
        system prompt and differ in a short question are not saved each)."""
        from array import array

        if len(tokens) < self.min_tokens or not (conversation or computed >= self.min_tokens):
            return False
        self._refresh()
        mine = array("i", tokens)
        return not any(len(h.tokens) >= len(mine) and _shared_prefix(h.tokens, mine) == len(mine)
                       for h in self._heads())

    def save(self, L: Any, ctx: Any, slot: int, tokens: list[int], job_id: str) -> None:
        """Copy sequence ``slot``'s state (exactly ``tokens``' cells) out of ``ctx`` and queue it
        for the Saver; dropped when it would take the states waiting past NRVNA_CACHE_PENDING
        bytes (never waited for)."""
        import ctypes

        size = L.llama_state_seq_get_size(ctx, slot)
        if not size:  # nothing to save
            return
        with self._lock:
            limit = self.pending_limit
            if self._waiting >= SAVES_PENDING if limit is None else self._pending + size > limit:
                self.counts["dropped"] += 1
                why = ("the disk is behind" if self._pending else
                       f"its {size / _MIB:,.0f} MiB are more than NRVNA_CACHE_PENDING ({(limit or 0) / _MIB:,.0f} MiB)")
                log.limited("state pending", f"a computed context was not saved: {why}", "warning")
                return
            self._pending += size
            self._waiting += 1
        try:
            data, offset = state_buffer(self.fingerprint, job_id, tokens, size, self.owner)
            copied = L.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(data, offset), size, slot)
        except MemoryError:
            copied = 0
        if copied != size or len(data) > self.limit:
            with self._lock:
                self._pending -= size
                self._waiting -= 1
            return
        self._queue.put((state_name(self.fingerprint, tokens), data, size))
        if self._saver is None:
            self._saver = threading.Thread(target=self._run, name="Saver", daemon=True)
            self._saver.start()

    def _run(self) -> None:
        _name_os_thread("Saver")
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, data, size = item
            try:
                self._write(name, data)
                self.evict()
            except Exception as err:  # a save is worth little: never take the daemon down
                log.limited(f"state save:{type(err).__name__}", f"saving a computed context failed: {err!r}")
            finally:
                with self._lock:
                    self._pending -= size
                    self._waiting -= 1

    def _write(self, name: str, data: Any) -> None:
        """Write a state whole: a temporary name, fsync, rename, the folder's fsync."""
        seal_state(data)
        temp = os.path.join(self.folder, state_temp_name(name))
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, os.path.join(self.folder, name))
            fsync_dir(self.folder)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            log.limited(f"state write:{err.errno}", f"a computed context was not saved ({_os_error(err)}); "
                        "jobs are not affected", "warning")
            return
        head = read_state_head(self.folder, name)
        with self._lock:
            if head is not None:
                self._index[name] = head
            self.counts["saved"] += 1

    def evict(self) -> None:
        """Remove the least recently used of this store's owner's states (any fingerprint's;
        and those saved before owners were recorded) while they hold more than the bound. The
        states of another workspace sharing the folder count against its own bound, never
        this one's; a file that is not a whole state of nrvna's is never counted nor removed."""
        self._refresh()
        with self._lock:
            mine = {n for n, h in self._index.items() if not self.owner or h.owner in ("", self.owner)}
        files = []
        with contextlib.suppress(OSError), os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name in mine:
                    with contextlib.suppress(OSError):
                        info = entry.stat(follow_symlinks=False)
                        files.append((info.st_mtime, entry.name, info.st_size))
        total = sum(size for _, _, size in files)
        for _, name, size in sorted(files):
            if total <= self.limit:
                break
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))
            total -= size
            with self._lock:
                self._index.pop(name, None)

    def close(self) -> None:
        """Write the pending saves and stop the Saver."""
        if self._saver is not None:
            self._queue.put(None)
            self._saver.join()
            self._saver = None


# ============================================================================
# 11.7 Continuous batching
# ============================================================================
# LlamaSession: a worker's context stepping every running job a token at a time (_Batch.fill,
# decode, sample and end), sharing prefixes (_PrefixCache) and yielding to higher priorities
# (_Preemption, the one field another thread sets). One worker's.


class _PrefixCache:
    """Prefix sharing in a context's unified KV cache: the cells finished jobs left in their
    free slots, kept for the prompts of the next jobs, and a new sequence's longest computed
    prefix found among them and its batch-mates' cells (see attach).

    Threads: like its context, its session's worker thread only."""

    def __init__(self, L: Any, memory: Any, slots: int, enabled: bool, shares_cells: bool = True) -> None:
        self.L = L
        self.memory = memory
        self.enabled = enabled  # NRVNA_PREFIX_CACHE: off, every prompt is computed whole
        self.shares_cells = shares_cells  # False for recurrent models: no prefix of a state can be copied
        self.held: list[list[int]] = [[] for _ in range(slots)]  # tokens cached in each free slot
        self.reused_tokens = 0
        self.trimmed = False  # trim() has trimmed the held cells since the last job started
        self.last_kept: Optional[int] = None  # the slot whose job ended last, cells kept whole

    def trim(self, slots: list[Optional[_Sequence]]) -> None:
        """No job in flight: of the cells finished jobs left, keep the last job's whole and
        of the others only the prefixes that several share (a system prompt, the chat
        template's opening).

        Attention scans the KV cache up to its highest used cell, masked cells too, so a
        batch's leftover cells slow every later decode (measured: a lone job's step 9.0-9.4
        ms after a batch, as fast as in a fresh context once trimmed); a shared prefix is
        what the next job can reuse. The last job's cells stay whole: a conversation's next
        turn, or the same prompt again, starts with all of them (and the next job that shares
        no more with any slot than the common prefix takes that slot, freeing its tail).
        """
        held = [i for i, tokens in enumerate(self.held) if tokens]
        if self.trimmed or len(held) < 2 or any(s is not None for s in slots):
            return
        self.trimmed = True  # until the next job: the worker calls this on every idle turn
        for i in held:
            if i == self.last_kept:
                continue
            keep = max(_common_prefix(self.held[i], self.held[j]) for j in held if j != i)
            if keep < len(self.held[i]):
                if not self.L.llama_memory_seq_rm(self.memory, i, keep, -1):
                    self.L.llama_memory_seq_rm(self.memory, i, -1, -1)
                    keep = 0
                self.held[i] = self.held[i][:keep]

    def take_slot(self, slots: list[Optional[_Sequence]], tokens: list[int]) -> int:
        """The free slot for a job with prompt ``tokens`` that is starting (trim() may trim
        again once it has ended): the one already holding the longest prefix of its prompt (a
        finished job's cells; on a tie, the slot trim() left whole: the new job's cells replace
        its tail)."""
        self.trimmed = False
        free = [i for i, s in enumerate(slots) if s is None]
        if not self.enabled:
            return free[0]
        return max(free, key=lambda i: (_common_prefix(self.held[i], tokens), i == self.last_kept))

    def make_room(self, slots: list[Optional[_Sequence]], cells: int) -> None:
        """Forget finished jobs' cells (kept for prefix reuse) while they and the running
        jobs' budgets could together overflow the cache of ``cells``; the last job's cells go
        last.

        Counting every slot's cells as its own overstates what shared prefixes use, so this
        is safe: the cells actually in use never exceed the cache.
        """
        used = sum(s.budget for s in slots if s is not None) + sum(len(t) for t in self.held)
        for i in sorted((i for i, t in enumerate(self.held) if t), key=lambda i: (i == self.last_kept, -len(self.held[i]))):
            if used <= cells:
                return
            used -= len(self.held[i])
            self.forget(i)

    def spare_slot(self, slots: list[Optional[_Sequence]]) -> int:
        """A free slot for a job's further choice: the one whose kept cells are worth least."""
        return min((i for i, s in enumerate(slots) if s is None), key=lambda i: (i == self.last_kept, len(self.held[i])))

    def forget(self, slot: int) -> None:
        """Drop every KV cell of ``slot`` (cells another slot shares stay for that slot)."""
        if self.last_kept == slot:
            self.last_kept = None
        self.held[slot] = []
        self.L.llama_memory_seq_rm(self.memory, slot, -1, -1)

    def release(self, seq: _Sequence, keep: bool) -> None:
        """``seq`` has left its slot; with ``keep``, its KV cells stay for the next job's prefix."""
        if keep and self.enabled:
            self.held[seq.slot] = seq.cached
            self.last_kept = seq.slot
        else:
            self.forget(seq.slot)

    def attach(self, seq: _Sequence, slots: list[Optional[_Sequence]], first: bool = False) -> None:
        """Give a new sequence the longest computed prefix of its prompt in this context.

        Batch jobs usually share a long system prompt. Its KV cells are shared, not
        recomputed: kept in the sequence's own slot (with ``first``, when its job starts: the
        tokens its slot's last job left), or copied from any other slot with
        ``llama_memory_seq_cp`` (in a unified KV cache a copy only tags the cells with one
        more sequence). When a batch-mate is still computing a longer shared prefix, the
        sequence waits for it (a step or two) instead of computing the same cells itself.
        """
        tokens, limit = seq.prompt, len(seq.prompt) - 1  # the last prompt token is decoded for its logits
        if seq.choice:
            self._attach_choice(seq, slots, limit)
            return
        own = _common_prefix(self.held[seq.slot], tokens) if first and self.enabled else 0
        source, computed, planned = seq.slot, own, 0
        if self.enabled:
            for i, other in enumerate(slots):
                if i == seq.slot:
                    continue
                if other is None:
                    n = _common_prefix(self.held[i], tokens, limit)
                elif other.waiting:
                    continue
                else:
                    n = _common_prefix(other.cached, tokens, limit)
                    # Never wait for a lower-priority batch-mate: it is paused while this one runs.
                    if other.pending and n == len(other.cached) and other.priority >= seq.priority:
                        planned = max(planned, _common_prefix(other.cached + other.pending, tokens, limit))
                if n > computed:
                    source, computed = i, n
        computed = min(computed, limit)
        seq.waiting = planned >= computed + PREFIX_WAIT_TOKENS
        if seq.waiting:
            self.L.llama_memory_seq_rm(self.memory, seq.slot, -1, -1)
            self.held[seq.slot] = []
            return
        if source == seq.slot:
            ok = self.L.llama_memory_seq_rm(self.memory, seq.slot, computed, -1)
        else:
            ok = (self.L.llama_memory_seq_rm(self.memory, seq.slot, -1, -1) and computed > 0)
            if ok:
                self.L.llama_memory_seq_cp(self.memory, source, seq.slot, 0, computed)
        if not ok:  # e.g. recurrent models: a sequence's state is all or nothing
            self.L.llama_memory_seq_rm(self.memory, seq.slot, -1, -1)
            computed = 0
        self.held[seq.slot] = []
        seq.at(computed)
        self.reused_tokens += computed

    def _attach_choice(self, seq: _Sequence, slots: list[Optional[_Sequence]], limit: int) -> None:
        """A job's second or later choice: the prompt's cells copied from a choice that has
        computed them, or a wait for the first choice to (whatever NRVNA_PREFIX_CACHE says:
        n choices compute their prompt once). Only its last token is decoded again, for this
        choice's own logits."""
        self.forget(seq.slot)
        seq.at(0)
        if not self.shares_cells:  # a recurrent model's state is all or nothing: each choice computes its own
            seq.waiting = False
            return
        source = next((i for i, other in enumerate(slots) if other is not None and other is not seq
                       and other.choices is seq.choices and not other.waiting and len(other.cached) >= limit), None)
        seq.waiting = source is None
        if source is None:
            return
        if limit:
            self.L.llama_memory_seq_cp(self.memory, source, seq.slot, 0, limit)
        seq.at(limit)
        self.reused_tokens += limit

    def keep_choice(self, seq: _Sequence) -> bool:
        """A job's further choice starting in the slot where another of its choices has just
        ended: keep the prompt's cells there but its last token's (decoded again for this
        choice's own logits). False where the cells cannot be cut (a recurrent model's)."""
        limit = len(seq.prompt) - 1
        if not (self.shares_cells and self.L.llama_memory_seq_rm(self.memory, seq.slot, limit, -1)):
            return False
        seq.at(limit)
        self.reused_tokens += limit
        return True


class _Batch:
    """A context's llama_batch, filled anew for each step (``fill``): one entry per token
    decoded (token, position, slot, whether its logits are wanted).

    Threads: its session's worker thread only."""

    def __init__(self, L: Any, n_batch: int) -> None:
        self.L = L
        self.n_batch = n_batch
        self.raw = L.llama_batch_init(n_batch, 0, 1)
        self.seq_ids = self.raw.seq_id[:n_batch]  # each entry's own array of sequence IDs, found once
        self.size = 0  # entries filled for this step
        self.chunks = False  # whether prompt chunks are among them

    def put(self, index: int, token: int, pos: int, slot: int, logits: bool) -> None:
        raw = self.raw
        raw.token[index] = token
        raw.pos[index] = pos
        raw.n_seq_id[index] = 1
        self.seq_ids[index][0] = slot
        raw.logits[index] = logits

    def fill(self, slots: list[Optional[_Sequence]], top: int) -> list[tuple[_Sequence, int]]:
        """Fill the batch for a step of the sequences of priority ``top`` (the others pause):
        the last token of every generating sequence first, then prompt chunks in the room
        left. Returns the sequences whose logits the step gives, each with its entry, in
        batch order (llama.cpp stores the logits asked for in that order)."""
        wanted: list[tuple[_Sequence, int]] = []
        n, chunks = 0, False
        for seq in slots:
            if seq is not None and not seq.pending and not seq.waiting and seq.priority == top:
                self.put(n, seq.last, seq.feed_last(), seq.slot, True)
                wanted.append((seq, n))
                n += 1
        for seq in slots:
            if seq is None or not seq.pending or seq.waiting or n >= self.n_batch or seq.priority != top:
                continue
            chunk, pos = seq.feed_chunk(self.n_batch - n)
            chunks = True
            for token in chunk:
                self.put(n, token, pos, seq.slot, False)
                pos += 1
                n += 1
            if not seq.pending:
                self.raw.logits[n - 1] = 1
                wanted.append((seq, n - 1))
        self.raw.n_tokens = self.size = n
        self.chunks = chunks
        return wanted

    def free(self) -> None:
        self.L.llama_batch_free(self.raw)


class _Preemption:
    """Cutting a context's decode short (Session.preempt): llama.cpp asks abort_callback(flag)
    between the graph's nodes; the callback is libc's strlen (see _strlen_callback): an empty
    flag goes on, a one-byte flag stops. A step with prompt chunks is never cut (``allow``).

    Threads: ``request`` from any thread (the Scanner's or another worker's, through
    Server._outranked), the rest from the session's worker. One byte is written and read,
    no lock: a request that lands after the worker's ``clear`` cuts its next step, which the
    sequences take again (the cut step changes nothing)."""

    def __init__(self, L: Any, ctx: Any, callback: Any) -> None:
        import ctypes

        self.L, self.ctx, self.callback = L, ctx, callback
        self.byref = ctypes.byref
        self.flag = ctypes.create_string_buffer(2)
        self.never = ctypes.create_string_buffer(2)  # for steps that cannot be cut (prompt chunks)
        self.abortable: Optional[bool] = None

    def request(self) -> None:
        self.flag[0] = b"x"

    def clear(self) -> None:
        self.flag[0] = b"\0"

    def allow(self, allowed: bool) -> None:
        """Let a request cut the coming decode short, or not (a step with prompt chunks: the
        aborted ubatch's cells are dropped, but a chunked prompt's earlier ubatches stay)."""
        allowed = allowed and self.callback is not None
        if allowed != self.abortable:
            flag = self.flag if allowed else self.never
            self.L.llama_set_abort_callback(self.ctx, self.callback, self.byref(flag))
            self.abortable = allowed


def _llama_context(runner: LlamaRunner, cells: int, n_batch: int, seqs: int, threads: int) -> tuple[Any, dict[str, float]]:
    """A llama context of ``cells`` tokens for ``seqs`` sequences, and its buffers as llama.cpp
    states them ({"KV", "compute", "output": MiB}); ModelError if it cannot be made, ConfigError
    (exit 2) where NRVNA_KV_TYPE asks for a quantized cache llama.cpp cannot make here."""
    L = runner.L
    params = L.llama_context_default_params()
    params.type_k, params.type_v, params.flash_attn_type = _kv_params(L, runner.config)
    params.n_ctx = cells
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = seqs
    params.n_threads = threads
    params.n_threads_batch = threads
    # One KV cache shared by the sequences: a shared prefix's cells serve many sequences,
    # and every step is one ubatch. Per-sequence streams split a step into one ubatch per
    # run of consecutive slot numbers (llama.cpp's split_equal): 3 weight passes instead
    # of 1 once slots free up out of order. Measured 3-10% more tok/s with mixed lengths.
    params.kv_unified = True
    params.no_perf = True
    ctx, sizes = _new_context(L, runner.model, params)
    if not ctx:
        reason = _llama_log_reason(": {}")
        if runner.config.kv_type != "f16":
            raise ConfigError(f"NRVNA_KV_TYPE={runner.config.kv_type}: llama.cpp cannot make a quantized KV cache "
                              f"for this model here{reason or ' (it needs flash attention)'}; use f16")
        raise ModelError(f"cannot create a llama context of {params.n_ctx} tokens{reason} "
                         "(out of memory? lower NRVNA_MAX_CTX, NRVNA_SEQS or NRVNA_WORKERS)")
    return ctx, sizes


class LlamaSession(Session):
    """One worker's llama context, generating up to ``seqs`` jobs at once.

    Every step decodes one token of every generating sequence, plus prompt chunks of newly
    started ones, in a single ``llama_decode``: continuous batching. With ``seqs=1`` it is
    the plain one-job-at-a-time loop. The session schedules the sequences (_Sequence; a job's
    n choices: _Choices), fills the batch (_Batch), decodes it and hands each sequence its
    logits: its _JobSampler draws the token, the sequence makes its text; _PrefixCache shares
    KV cells between prompts.

    Threads: its worker's thread only, but ``preempt`` (any thread: see _Preemption); the
    runner's Grammar thread makes the grammars of jobs in ``converting`` and hands them over
    through their _Conversion (an Event).
    """

    def __init__(self, runner: LlamaRunner, threads: int, seqs: int, n_batch: int,
                 config: Optional[Config] = None) -> None:
        self.runner = runner
        self.L = runner.L
        # NRVNA_MAX_CTX is each worker's context, shared by its sequences: S sequences must
        # not multiply the KV memory by S. It holds FULL_LENGTH_SEQS jobs of the full length;
        # more sequences run as the jobs' budgets leave room (see free), since a batch's
        # short jobs use a fraction of their share and wider steps cost less per token.
        full = min(seqs, FULL_LENGTH_SEQS)
        per_seq = max(64, (config or runner.config).max_ctx // full)
        if runner.train_ctx > 0:
            per_seq = min(per_seq, runner.train_ctx)
        self.config = config or runner.config
        self.ctx_per_seq = per_seq  # enforced here: a unified cache would let one sequence take all
        self.embedder: Optional[_Embedder] = None  # made when the first embed job arrives
        self.threads = self.base_threads = threads
        # Beyond them, one slot and one job's share of cells are kept for a job above every
        # running one (priority): it starts at once and they pause, keeping their cells.
        self.seqs = seqs
        self.normal_cells = per_seq * full
        self.cells = self.normal_cells + per_seq
        # Jobs whose grammar the runner's Grammar thread is making (prepare_grammar): each holds
        # a slot and a full share of cells, and starts at the first step after it is made.
        self.converting: list[tuple[RunningJob, _Conversion]] = []
        self.ctx: Any = None
        self.slots: list[Optional[_Sequence]] = []
        self.saves: list[tuple[int, list[int], str]] = []  # ended sequences' contexts to save (save_ended)
        if runner.embedding_only:  # no generation context: generation jobs fail at start()
            return
        self.ctx, self.buffers = _llama_context(runner, self.cells, n_batch, seqs + 1, threads)
        self.memory = self.L.llama_get_memory(self.ctx)
        self.batch = _Batch(self.L, n_batch)
        self.slots = [None] * (seqs + 1)
        self.prefixes = _PrefixCache(self.L, self.memory, seqs + 1, bool(runner.config.prefix_cache),
                                     not (self.L.llama_model_is_recurrent(runner.model)
                                          or self.L.llama_model_is_hybrid(runner.model)))
        self.preempted = 0  # steps cut short by preempt()
        self.preemption = _Preemption(self.L, self.ctx, runner.abort_callback)
        self.templates = _GrammarTemplates(runner)
        self.scratch = _SamplingScratch(runner)  # the arrays this context's samplers draw with

    def preempt(self) -> None:
        if self.ctx is not None:
            self.preemption.request()

    def clear_preempt(self) -> None:
        if self.ctx is not None:
            self.preemption.clear()

    def set_threads(self, threads: int) -> None:
        """Decode with ``threads`` CPU threads from the next step on (a setting of the
        context: nothing is reallocated)."""
        if threads != self.threads:
            for ctx in (self.ctx, self.embedder and self.embedder.ctx):
                if ctx:
                    self.L.llama_set_n_threads(ctx, threads, threads)
            self.threads = threads

    def free(self) -> int:
        """How many jobs can start now (more may once these have started).

        The KV cache holds ``cells`` tokens, ``FULL_LENGTH_SEQS`` jobs of the full
        per-job length. A running job needs at most its budget (prompt plus max_tokens,
        capped at that length), and a new job is taken only while the budgets leave room
        for one of full length, since its size is known only once it is claimed. So the
        cache never overflows (a failed decode would fail every job in it), and a batch of
        short jobs fills every slot.
        """
        embed = EMBED_JOBS - (len(self.embedder.jobs) if self.embedder is not None else 0)
        if self.ctx is None:
            return embed
        if _Choices.waiting(self.slots):  # a job's choices not yet started have the room first
            return 0
        running, room = self.room()
        parked = len(self.converting)
        return max(0, min(self.seqs - running - parked, room // self.ctx_per_seq - parked, embed))

    def room(self) -> tuple[int, int]:
        """The sequences running outside the kept room, and the cells their budgets leave."""
        running = [s for s in self.slots if s is not None and not s.reserved]
        return len(running), self.normal_cells - sum(s.budget for s in running)

    def reserve(self, priority: int) -> int:
        """1 if a job of ``priority`` would run above every job here and the kept room is free
        (0 while a job's grammar is being made: that job may need the room)."""
        return 0 if self.converting else self._reserve(priority)

    def _reserve(self, priority: int) -> int:
        if self.ctx is None or any(s is not None and (s.reserved or s.priority >= priority) for s in self.slots):
            return 0
        return 1 if self.embedder is None or len(self.embedder.jobs) < EMBED_JOBS else 0

    def idle(self) -> None:
        """No job in flight: trim the cells finished jobs left to the prefixes the next jobs
        can reuse (see _PrefixCache.trim)."""
        if self.ctx is not None:
            self.save_ended()
            self.prefixes.trim(self.slots)

    def save_ended(self) -> None:
        """Copy the contexts of the jobs that ended last step out for the runner's Saver: after
        their results were handed on (a 184 MB copy is not in a job's latency), and before
        anything else touches their cells (a new job's start, a step, a trim, a drop)."""
        saves, self.saves = self.saves, []
        for slot, tokens, job_id in saves:
            self.runner.store.save(self.L, self.ctx, slot, tokens, job_id)

    def active(self) -> list[RunningJob]:
        """The jobs generating in this context, then those whose grammar is being made, then
        the embed jobs."""
        embedding = [e.job for e in self.embedder.jobs] if self.embedder is not None else []
        converting = [job for job, _ in self.converting]
        return list(dict.fromkeys(s.job for s in self.slots if s is not None)) + converting + embedding  # a job of n choices once

    def start(self, job: RunningJob) -> None:
        """Take ``job`` into a free slot; raise JobError if its prompt cannot run here. A start
        that fails in any way leaves nothing of the job here (its caller ends it: a slot still
        holding it would end it twice)."""
        self.save_ended()
        try:
            if job_param(job.params, "embed"):
                self._embedder().start(job)
                return
            if self.ctx is None:
                raise JobError("unsupported", f"the model is an embedding model ({self.runner.arch}): it serves "
                                              "embed jobs only (submit --embed)")
            conversion = self.runner.prepare_grammar(job.params)
            if conversion is not None:  # made on the Grammar thread while the others step; begun then
                self.converting.append((job, conversion))
                return
            self._begin(job)
        except BaseException:
            self.drop(job)
            raise

    def sampler(self, params: Mapping[str, Any], made: Optional[tuple[Any, str, GrammarShape]] = None
                ) -> _JobSampler:
        """A sampler for a sequence of a job with ``params`` (``made``: its grammar, made), drawing
        with this context's arrays and grammars; JobError if the model cannot take them."""
        return _JobSampler.for_job(self.runner, self.scratch, self.templates, params, made)

    def _begin(self, job: RunningJob, made: Optional[tuple[Any, str, GrammarShape]] = None) -> None:
        """Start ``job`` in a free slot (``made``: its grammar); JobError if it cannot run here."""
        max_tokens = job_param(job.params, "max_tokens", self.runner.config)
        tokens, think = self.runner.tokens(job), None
        if self.runner.thinking is not None:
            tokens, think = self.runner.thinking.start(tokens, job.params, max_tokens, self.ctx_per_seq)
        if len(tokens) >= self.ctx_per_seq:
            holder = "the context holds" if self.seqs == 1 else "a sequence holds"
            raise JobError("context_overflow", f"prompt is {len(tokens)} tokens; {holder} {self.ctx_per_seq}")
        if not tokens:
            raise JobError("bad_request", "prompt has no tokens")
        priority = job_param(job.params, "priority")
        reserved = self.free() <= 0
        if reserved and self._reserve(priority) <= 0:  # a caller's bug: the worker checks before it claims
            raise RuntimeError("no room for another job in this context")
        slot = self.prefixes.take_slot(self.slots, tokens)
        budget = min(self.ctx_per_seq, len(tokens) + max_tokens)
        seq = self.slots[slot] = _Sequence(job, slot, tokens, max_tokens, budget, self.sampler(job.params, made))
        seq.reserved = reserved
        if self.runner.end_marks and not job_param(job.params, "raw") and not self.runner.has_grammar(job.params):
            seq.stops = seq.stops + list(self.runner.end_marks)  # the fallback form's turn ends, written as text
        seq.think_with(think)
        seq.tools = self.runner.tool_format if tool_choice(job.params) != "none" else None
        self.prefixes.attach(seq, self.slots, first=True)
        n = job_param(job.params, "n")
        if n > 1:
            _Choices.begin(self, seq, n)
        self.prefixes.make_room(self.slots, self.cells)
        if self.runner.store is not None and self.prefixes.enabled and not seq.waiting:
            self._restore(seq, self.runner.store)

    def _restore(self, seq: _Sequence, store: StateStore) -> None:
        """Give ``seq`` a saved state's cells where one covers more of its prompt than this
        context's memory did (by RESTORE_GAIN_TOKENS): read, restored into its slot, cut back to
        the prefix they share (full attention only). The last prompt token is always decoded:
        its logits are not saved."""
        found = store.find(seq.prompt, len(seq.prompt) - 1, seq.budget, self.runner.trimmable)
        if found is None or found[1] < seq.pos + RESTORE_GAIN_TOKENS:
            return
        head, shared = found
        self.prefixes.held[seq.slot] = []
        began = time.monotonic()
        if not store.restore(self.L, self.ctx, seq.slot, head):
            seq.at(0)  # its slot was emptied: the whole prompt is computed
            return
        if shared < len(head.tokens) and not self.L.llama_memory_seq_rm(self.memory, seq.slot, shared, -1):
            self.L.llama_memory_seq_rm(self.memory, seq.slot, -1, -1)
            seq.at(0)
            return
        seq.at(shared)
        seq.from_disk = shared
        log.debug(f"Job {seq.job.id}: {shared} of {len(seq.prompt)} prompt tokens from saved state {head.name} "
                  f"in {(time.monotonic() - began) * 1000:.0f} ms")

    def _embedder(self) -> _Embedder:
        """The worker's embedding context, made on first use."""
        if self.runner.pooling not in ("mean", "cls", "last"):
            raise JobError("unsupported", f"the model cannot embed with pooling {self.runner.pooling} (its GGUF "
                                          "names no pooling type): start the daemon with NRVNA_POOLING=mean, cls "
                                          "or last to embed with it")
        if self.embedder is None:
            self.embedder = _Embedder(self.runner, self.threads, self.ctx_per_seq, EMBED_PACK)
        return self.embedder

    def _decode(self, ctx: Any, batch: Any) -> int:
        """``llama_decode`` with this worker's threads, or on the runner's thread for borrowed ones."""
        if self.threads > self.base_threads:  # borrowed threads: see LlamaRunner.decode_wide
            return self.runner.decode_wide(ctx, batch)
        self.runner.wait_wide()
        return self.L.llama_decode(ctx, batch)

    def step(self) -> list[tuple[RunningJob, Outcome]]:
        """One ``llama_decode`` for every generating job and one for texts of embed jobs;
        return the jobs that ended, with outcomes. Jobs whose grammar has been made begin."""
        self.save_ended()
        ended = self._converted() if self.converting else []
        stepping = any(s is not None for s in self.slots) or (self.embedder is not None and bool(self.embedder.jobs))
        ended += self._generate() if self.ctx is not None else []
        if self.embedder is not None and self.embedder.jobs:
            ended += self.embedder.step(self._decode)
        if not stepping and not ended and self.converting:  # nothing else to do: wait a little, not spin
            self.converting[0][1].done.wait(CONVERSION_POLL)
        return ended

    def _converted(self) -> list[tuple[RunningJob, Outcome]]:
        """Begin the jobs whose grammar is made, if there is room (choices of a running job may
        have taken theirs: then they wait for it); end those cancelled or timed out meanwhile,
        and those whose grammar or start failed, each alone."""
        ended = []
        for entry in list(self.converting):
            job, conversion = entry
            if job.interrupt is None and not conversion.done.is_set():
                continue
            self.converting.remove(entry)
            try:
                if job.interrupt is not None:
                    raise JobError(*job.interrupt)
                if conversion.error is not None:
                    raise conversion.error
                if self.free() <= 0 and self._reserve(job_param(job.params, "priority")) <= 0:
                    self.converting.append(entry)
                    continue
                self._begin(job, conversion.found)
            except JobError as err:
                self.drop(job)  # a JobError may come once the job holds a slot
                ended.append((job, Outcome(error_code=err.code, error=str(err))))
            except Exception as err:  # as a failed start: this job alone
                self.drop(job)
                ended.append((job, Outcome(error_code="runner_error", error=f"runner failed: {err!r}")))
        return ended

    def _generate(self) -> list[tuple[RunningJob, Outcome]]:
        """One ``llama_decode`` for every generating job; return those that ended. The step in
        its parts: ready the sequences (_ready), fill the batch (_Batch.fill), decode it
        (_decode_batch), then draw each sequence's token and end those that are done (_sample)."""
        ended = self._ready()
        # Only the highest priority here steps: the others pause, keeping their cells and
        # their samplers' state, and go on where they were once it has ended.
        top = max((seq.priority for seq in self.slots if seq is not None), default=0)
        wanted = self.batch.fill(self.slots, top)
        if self.batch.size:
            failed = self._decode_batch(wanted)
            ended += self._sample(wanted) if failed is None else failed
        return [each for each in ended if each is not None]

    def _ready(self) -> list[Optional[tuple[RunningJob, Outcome]]]:
        """Before a step: slots freed by other jobs go to choices not yet started; the jobs
        cancelled or timed out end (their outcomes, None for a job's choice that leaves
        others); sequences waiting for a batch-mate's prefix look for it again."""
        for seq in _Choices.waiting(self.slots):
            assert seq.choices is not None
            seq.choices.admit(self, seq)
        ended = [self._end(seq, error=seq.job.interrupt) for seq in self.slots
                 if seq is not None and seq.job.interrupt is not None]  # cancelled, timed out
        for seq in self.slots:
            if seq is not None and seq.waiting:
                self.prefixes.attach(seq, self.slots)
        return ended

    def _decode_batch(self, wanted: list[tuple[_Sequence, int]]) -> Optional[list[Optional[tuple[RunningJob, Outcome]]]]:
        """Decode the filled batch: None when it is decoded. Otherwise the step is over: []
        when preempt() cut it short (llama.cpp dropped its cells; the sequences take the
        step again), or every sequence's end when the decode failed."""
        self.preemption.allow(not self.batch.chunks)  # one token per sequence: nothing to undo but these
        code = self._decode(self.ctx, self.batch.raw)
        if code == 2 and self.preemption.abortable:  # preempted: llama.cpp dropped this step's cells
            for seq, _ in wanted:
                seq.unfeed_last()
            self.preempted += 1
            return []
        if code != 0:
            # The batch is shared by every sequence in it: they cannot be told apart.
            message = {1: "no room left in the KV cache", 2: "decode aborted"}.get(code, f"llama_decode returned {code}")
            return [self._end(seq, error=("model_error", message), keep=False) for seq in self.slots if seq is not None]
        return None

    def _sample(self, wanted: list[tuple[_Sequence, int]]) -> list[Optional[tuple[RunningJob, Outcome]]]:
        """After a decode: each sequence's logits readied by its sampler, the likeliest tokens
        of every row found at once (for the samplers' shortlists), then each sequence's token
        drawn and taken (_take); the outcomes of those that ended."""
        if not wanted:  # prompt chunks only
            return []
        np = self.runner.np
        # llama.h: the logits of the batch entries asked for are stored in their batch order,
        # one row each; ``wanted`` is in batch order.
        matrix = np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(len(wanted), self.runner.n_vocab))
        for (seq, _), row in zip(wanted, matrix):
            seq.sampler.prepare(row)
            if seq.think is not None and seq.think.state in (_ThinkRouter.BEFORE, _ThinkRouter.AFTER):
                row[self.runner.eog_ids] = -np.inf  # a thinking model's answer is never empty
        sizes = [seq.sampler.shortlist_size for seq, _ in wanted]
        likeliest = _likeliest(np, matrix, list(range(len(wanted))), sizes) if any(sizes) else [None] * len(wanted)
        ended = []
        for (seq, index), row, short in zip(wanted, matrix, likeliest):  # each its logits: its sampler draws, its text goes on
            if self.slots[seq.slot] is not seq:  # a choice of a job that a batch-mate choice failed
                continue
            end = self._take(seq, index, row, short)
            if end is not None:
                ended.append(self._end(seq, *end))
        return ended

    def _take(self, seq: _Sequence, index: int, row: Any, short: Optional[tuple[Any, Any]]
              ) -> Optional[tuple[str, Optional[tuple[str, str]]]]:
        """``seq``'s next token drawn from output ``index`` (``row``; ``short``: its likeliest
        tokens) and taken: None if the sequence goes on, else why it ends (its finish reason,
        and its error: code, message)."""
        # A token the daemon writes (closing a thinking block) is never drawn, and the grammar,
        # the penalties and the log-probabilities never see it.
        think = seq.think
        token = think.forced(seq.n_gen) if think is not None and (think.forcing or think.state == _ThinkRouter.INSIDE) else -1
        if token < 0:
            drawn = self._draw(seq, index, row, short)
            if isinstance(drawn, tuple):
                return drawn
            if drawn >= 0:
                seq.sampler.accept(drawn)
            token = drawn if drawn >= 0 else -drawn - 1
        if seq.add(token, self.runner.piece(token)):  # a stop string
            return "stop", None
        if seq.n_gen >= seq.max_tokens or seq.pos >= self.ctx_per_seq:
            return "length", None
        return None

    def _draw(self, seq: _Sequence, index: int, row: Any, short: Optional[tuple[Any, Any]]
              ) -> Union[int, tuple[str, Optional[tuple[str, str]]]]:
        """``seq``'s token drawn by its sampler (see _take): the token; -1 - a token the daemon
        writes instead (an end of generation inside a thinking block, or a close that would carry
        answer text past the grammar: the block is closed); or why the sequence ends."""
        try:
            token = seq.sampler.sample(self.ctx, index, row, short)
        except GrammarLimit as err:  # before llama.cpp is asked to do that work
            return "stop", ("grammar_error", f"{err} after {seq.n_gen} tokens")
        if token < 0:
            return "stop", ("grammar_error", "no token of the model's vocabulary can continue the grammar here")
        think, ends = seq.think, token in self.runner.eog_tokens
        if think is not None and think.state == _ThinkRouter.INSIDE and think.closing and (
                ends or (seq.sampler.grammar is not None and think.spills(self.runner.piece(token)))):
            return -1 - think.close_now("eog" if ends else "model")
        if ends and (not seq.ignore_eos or seq.sampler.grammar is not None):
            return "stop", None  # with a grammar: allowed only once it is complete
        return token

    def _end(self, seq: _Sequence, reason: str = "stop", error: Optional[tuple[str, str]] = None,
             keep: bool = True) -> Optional[tuple[RunningJob, Outcome]]:
        """``seq`` has ended: its job's outcome, or None while the job has other choices to end."""
        outcome = seq.outcome(reason, error)
        if seq.choices is not None:
            ended = seq.choices.end(self, seq, outcome, error, keep)
            return None if ended is None else (seq.job, ended)
        # A job that ran in the kept room leaves no cells: the jobs it paused go on over the very
        # cache they paused with (attention over extra cells computes the same text differently).
        self.release(seq, keep and not seq.reserved, save=error is None)
        return seq.job, outcome

    def release(self, seq: _Sequence, keep: bool, save: bool = False) -> None:
        """Free ``seq``'s slot; with ``keep``, its KV cells stay for the next job's prefix; with
        ``save`` too (its job is done), they are saved to disk when the runner's StateStore wants
        them (see StateStore.wants)."""
        store = self.runner.store
        if keep and save and store is not None and self.prefixes.enabled and seq.choices is None:
            params = seq.job.params
            conversation = job_param(params, "parent") is not None or any(
                t.get("role") == "assistant" for t in job_param(params, "messages") or ())
            if store.wants(seq.cached, conversation, seq.computed + seq.n_gen):
                self.saves.append((seq.slot, list(seq.cached), seq.job.id))  # copied out at save_ended
        self.slots[seq.slot] = None
        seq.sampler.free()
        self.prefixes.release(seq, keep)

    def drop(self, job: RunningJob) -> None:
        """Forget ``job`` (it is being handed back to the queue) and free its slot (a conversion
        of its grammar goes on for the jobs that share it, or is abandoned)."""
        self.save_ended()
        self.converting = [entry for entry in self.converting if entry[0] is not job]
        for seq in self.slots:
            if seq is not None and seq.job is job:
                self.release(seq, keep=False)
        if self.embedder is not None:
            self.embedder.drop(job)

    def close(self) -> None:
        """Free the contexts, their batches and every sampler."""
        if self.ctx is not None:
            self.save_ended()
        if self.embedder is not None:
            self.embedder.close()
        self.converting = []
        for seq in self.slots:
            if seq is not None:
                self.release(seq, keep=False)
        if self.ctx:
            self.templates.close()
            self.batch.free()
            self.L.llama_free(self.ctx)
            self.ctx = None


# ============================================================================
# 11.8 The runner
# ============================================================================
# LlamaRunner: the model loaded once and shared, the runner's caches (pieces, grammars, the
# Grammar and Wide threads) and a session per worker. Its docstring's Threads line says who calls
# what. HOST_CACHES lists every cache kept beside llama.cpp's buffers, with its bound.


# Every cache nrvna keeps beside llama.cpp's own buffers: (what, whose, its bound, what it holds,
# how it makes room). A bound naming a setting is that setting's value. The start line, `status
# --daemon` and docs/configuration.md's table come from here.
HOST_CACHES: tuple[tuple[str, str, str, str, str], ...] = (
    ("token texts", "the model", "its vocabulary", "each generated token's bytes, once seen",
     "none needed: one entry per token at most"),
    ("grammar vocabulary", "the model", f"{GRAMMAR_VOCAB_PARTIALS} half-done characters",
     "the vocabulary's code points, made for the first structured job (2 MiB for SmolLM2), and the tokens "
     "that can finish a character split over tokens", "the oldest character's first"),
    ("grammars converted", "the model", f"{GRAMMAR_CACHE}", "JSON schemas and grammars made into llama.cpp's GBNF",
     "least recently used"),
    ("grammars parsed", "each context", f"{GRAMMAR_TEMPLATES}", "llama.cpp's grammar samplers, copied for each job",
     "least recently used"),
    ("prompt prefixes", "each context", "its KV cells", "finished jobs' computed prompts, in the KV cache itself",
     "a finished job's cells, oldest first, when a job needs them"),
    ("contexts waiting to be saved", "the model", "NRVNA_CACHE_PENDING",
     "KV states copied out of a context for the Saver thread to write", "a save past it is skipped (logged)"),
    ("saved contexts, on disk", "the model", "NRVNA_CACHE_DISK", "KV states kept for later jobs and restarts",
     "least recently used"),
)


# A generation context's size as llama.cpp stated it when it was made: its buffers (_new_context's
# {"KV", "compute", "output": MiB}), its cells (llama.cpp rounds the count asked for up, to 256:
# its own count) and one job's share of them. Plain numbers, read by model_memory from any thread.
_ContextSize = namedtuple("_ContextSize", "buffers cells per_job")


# The chat form of a model whose GGUF holds no chat template (or one jinja cannot read): ChatML,
# as llama-server falls back to (llama.cpp's "chatml"), the model's BOS before it where its
# vocabulary adds one. Every chat job is rendered through it, its system message, its parent's
# turns and its messages alike, and tools take the generic form (docs/models.md); raw jobs are
# their caller's text. A model trained on another form answers worse, but never without its turns.
FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def host_caches(config: Config) -> dict[str, str]:
    """Each host cache's bound, settings given their values (the record's "caches")."""
    values = {setting.env: str(getattr(config, name)) for name, setting in SETTINGS.items()}
    return {what: (f"{values[bound]} ({bound})" if bound in values else bound)
            for what, _, bound, _, _ in HOST_CACHES}


def model_memory(runner: Any) -> dict[str, Any]:
    """What a loaded model holds as llama.cpp states it (MiB): its weights, and each of its
    generation contexts' KV cache (cells, bytes a token, type), compute and output buffers; its
    embedding contexts made so far. The start line, `status --daemon` and NRVNA_MAX_MEMORY
    read it.

    Any thread calls it (the Watcher writes the record while the Models thread may be closing
    the runner), so it reads only plain numbers stated when each context was made and the
    model's size read at load, never a context or the model through llama.cpp: those may be
    being freed under it."""
    with runner._lock:
        sessions = list(runner._sessions)
    contexts = [size for _, size in sessions if size is not None]
    first = contexts[0] if contexts else _ContextSize({}, 0, 0)
    kv, compute, output = (first.buffers.get(part, 0.0) for part in ("KV", "compute", "output"))
    cells, per_job = first.cells, first.per_job
    embedders = [s.embedder for s, _ in sessions]  # each read once: a dict made whole before it is set
    embedding = [sum(e.buffers.values()) for e in embedders if e is not None]
    weights = runner.weights_mib
    return {"weights_mib": round(weights, 1), "kv_type": runner.config.kv_type, "contexts": len(contexts),
            "cells": cells, "cells_per_job": per_job, "kv_bytes_per_token": round(kv * _MIB / cells) if cells else 0,
            "kv_mib": kv, "compute_mib": compute, "output_mib": output,
            "embedding_contexts": len(embedding), "embedding_mib": round(sum(embedding), 1),
            "total_mib": round(weights + len(contexts) * (kv + compute + output) + sum(embedding), 1)}


def memory_line(name: str, report: Mapping[str, Any]) -> str:
    """``model_memory``'s report as the start line says it. An embedding model has no
    generation context (no KV cache, compute or output buffers to count): its line says so, and
    what its workers' embedding contexts hold, each made at the worker's first embed job."""
    n = report["contexts"]
    if not n:
        made = report["embedding_contexts"]
        return (f"Memory of {name}: weights {report['weights_mib']:,.1f} MiB, no generation contexts (an embedding "
                f"model: each worker makes its embedding context at its first embed job; {made} made so far, "
                f"{report['embedding_mib']:,.1f} MiB): {report['total_mib']:,.1f} MiB")
    line = (f"Memory of {name}: weights {report['weights_mib']:,.1f} MiB, KV cache {n} x {report['kv_mib']:,.1f} MiB "
            f"({report['kv_type']}, {report['cells']:,} cells x {report['kv_bytes_per_token']:,} B a token), "
            f"compute {n} x {report['compute_mib']:,.1f} MiB, output {n} x {report['output_mib']:,.1f} MiB")
    if report["embedding_contexts"]:
        line += f", embedding contexts {report['embedding_mib']:,.1f} MiB"
    return line + f": {report['total_mib']:,.1f} MiB"


def tool_turns(messages: list[dict[str, Any]], params: Mapping[str, Any], variables: dict[str, Any],
           form: ToolFormat, spells_control: Callable[[str], bool]) -> list[dict[str, Any]]:
    """A job's turns as its template takes tools: in the generic form, the tools and any
    calls and answers as text (generic_messages); else as the template's own ``tools``
    variable and calls with their arguments as objects (templates write them ``| tojson``).
    What a template writes of them outside a message's content must spell no control token
    (``spells_control``: the model's test of a text)."""
    import json

    tools, choice = job_param(params, "tools"), tool_choice(params)
    history = any(t.get("tool_calls") or t["role"] == "tool" for t in messages)
    if not (tools or history):
        return messages
    if form.generic:
        return generic_messages(messages, tools, choice, parallel_calls(params))
    if tools and choice != "none":
        variables["tools"] = tools
    turns = []
    for turn in messages:
        turn = dict(turn, content=turn["content"] or "")
        if turn.get("tool_calls"):
            turn["tool_calls"] = [dict(call, function=dict(call["function"], arguments=json.loads(call["function"]["arguments"])))
                                  for call in turn["tool_calls"]]
        turns.append(turn)
    outside = json.dumps([variables.get("tools"), [(t.get("tool_calls"), t.get("name"), t.get("tool_call_id"))
                                                    for t in messages]], ensure_ascii=False)
    if spells_control(outside):
        raise JobError("bad_request", "a tool's definition or a call spells a control token of the model")
    return turns


def grammar_key(params: Mapping[str, Any], form: ToolFormat) -> Optional[tuple[str, Any, Mapping[str, Any]]]:
    """(its kind, the key naming it, the params that make it) of a constrained job's grammar
    (``form``: how the model writes tool calls)."""
    import json

    kind = constraint(params)
    if kind is None:
        return None
    if kind == "tools":  # descriptions left out: they change the prompt, not the grammar
        tools = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters")}
                 for t in job_param(params, "tools")]
        return kind, ("tools", json.dumps([form, tool_choice(params), parallel_calls(params), tools],
                                          ensure_ascii=False, separators=(",", ":"))), params
    if kind == "json_object":
        return kind, ("json_object",), {"grammar": _JSON_OBJECT_GBNF}
    if kind == "grammar":
        return kind, ("gbnf", job_param(params, "grammar")), params
    return kind, ("schema", json.dumps(job_param(params, "response_format")["json_schema"]["schema"],
                                       ensure_ascii=False, separators=(",", ":"))), params


class LlamaRunner(Runner):
    """llama.cpp through llama-cpp-python's raw API: one model, shared by every worker.

    ``Llama`` always loads its own copy of the weights, so it cannot be shared; the raw
    calls can. Each worker gets its own context (KV cache, batch, samplers), never shared
    between threads, which is llama.cpp's thread-safety rule.

    Threads: made, with its sessions, and closed by whoever loads the model (_Models: the
    start (Main), a switch or a load ahead (the Models thread)) while no worker uses it; called by
    every worker (tokens, piece, penalty, sampler, grammar, prepare_grammar, grammar_vocab,
    decode_wide, wait_wide), its Grammar thread (_convert) and its Wide thread (llama_decode).
    ``_grammars``, ``_converting``, ``_converter``, ``_grammar_vocab`` and ``conversions``
    are under ``_grammars_lock`` (never held while a grammar is made); ``_sessions`` under ``_lock``:
    ``memory`` reads them from any thread, only numbers stated at load (see model_memory), never the
    model or a context, which a swap may be freeing. A decode with borrowed threads runs under ``_wide_lock``. ``_pieces`` is a cache the
    workers fill without a lock: a token's bytes are the same whoever stores them, and one
    dict get or set is atomic. The model, its vocabulary and the tables made at load are read
    only (llama.cpp's model may be shared by contexts on several threads).
    """

    name = "llama.cpp"

    def __init__(self, model_path: str, config: Config, cancel: Optional[threading.Event] = None,
                 owner: str = "") -> None:
        """Load ``model_path``; ModelError says why not. Setting ``cancel`` cuts the load short
        (a daemon stopping while it loads a model ahead of its turn). ``owner``: its saved
        states' (state_owner of the daemon's workspace)."""
        check_gguf(model_path)
        self.L = L = _import_llama()
        self.config = config
        self.abort_callback = _strlen_callback(L)  # kept here: llama.cpp holds only its address
        self.model_name = os.path.basename(model_path)
        _install_llama_logging(L, config.log_level)
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.n_gpu_layers = config.gpu_layers
        if config.gpu >= 0:  # one GPU, whole: several daemons share a machine one GPU each
            params.main_gpu = config.gpu
            params.split_mode = 0  # LLAMA_SPLIT_MODE_NONE
        if not config.repack:
            params.use_extra_bufts = False  # no AMX/repacked buffers (llama.cpp #20824)
        if not config.mmap:
            _load_unmapped(L, params)
        if cancel is not None:  # kept here while llama.cpp may call it: it holds only its address
            self._progress = L.llama_progress_callback(lambda progress, data: not cancel.is_set())
            params.progress_callback = self._progress
        del _llama_log_tail[:]
        self.model = L.llama_model_load_from_file(model_path.encode(), params)
        if not self.model:
            if cancel is not None and cancel.is_set():
                raise ModelError(f"model {model_path}: its load was cut short (the daemon is stopping)")
            raise ModelError(f"model {model_path} could not be loaded by llama.cpp{_llama_log_reason(': {}')}")
        self.weights_mib = L.llama_model_size(self.model) / _MIB  # read now: model_memory never reads the model
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.train_ctx = L.llama_model_n_ctx_train(self.model)
        self.n_embd = L.llama_model_n_embd_out(self.model) or L.llama_model_n_embd(self.model)
        self.arch = self.meta("general.architecture") or "unknown"
        model_pooling = self.meta(f"{self.arch}.pooling_type")
        # An embedding model: one whose GGUF names a pooling type, or an encoder's architecture.
        self.embedding_only = model_pooling is not None or self.arch in ENCODER_ARCHS
        # Causal attention (a decoder, with a KV cache) unless the GGUF or the architecture says not.
        self.causal = self.meta(f"{self.arch}.attention.causal") != "false" and self.arch not in ENCODER_ARCHS
        if config.pooling != "model":
            self.pooling = config.pooling
        elif model_pooling is not None and model_pooling.isdigit() and int(model_pooling) < len(POOLING_CODES):
            self.pooling = POOLING_CODES[int(model_pooling)]  # "rank" (rerankers) embeds nothing here
        else:
            self.pooling = "none"
        if self.embedding_only and self.pooling not in ("mean", "cls", "last"):
            L.llama_model_free(self.model)
            raise ModelError(f"model {model_path} is an embedding model ({self.arch}), and its pooling is "
                             f"{self.pooling}: set NRVNA_POOLING to mean, cls or last")
        self._pieces: dict[int, bytes] = {}
        self.fallback = False  # no chat template: chat jobs in FALLBACK_TEMPLATE's form (_chat_formatter)
        self._formatter = None if self.embedding_only else self._chat_formatter()  # (an embedder generates nothing)
        template = (L.llama_model_chat_template(self.model, None) or b"").decode("utf-8", "replace")
        self.takes_effort = "reasoning_effort" in template  # gpt-oss's template reads it
        self.thinking = _Thinking.find(self, template, config.thinking_tags)  # None: the model does not think
        self.tool_format = find_tool_format(self._formatter)
        # The fallback form's markers that are text to this model (none of its tokens): an answer
        # that writes one has ended its turn, as if they were stop strings (Gemma 3 writes them).
        self.end_marks = tuple(mark for mark in ("<|im_end|>", "<|im_start|>")
                               if self.fallback and len(self.tokenize(mark, False, True)) > 1)
        import numpy  # llama-cpp-python's own dependency: log-probabilities, grammar resampling

        self.np = numpy
        self._grammars: dict[Any, tuple[str, GrammarShape]] = {}  # a schema or grammar -> its GBNF (LRU order)
        self._grammar_vocab: Optional[GrammarVocab] = None
        # End-of-generation tokens: a set, as every generated token is looked up (a call costs 1-2 us).
        self.eog_tokens = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        self.eog_ids = numpy.array(sorted(self.eog_tokens), dtype=numpy.int64)  # to ban them from a row at once
        # Control tokens but end-of-generation: never in a constrained output (see _JobSampler._allowed).
        self.control_tokens = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_control(self.vocab, t)
                                        and t not in self.eog_tokens)
        self.control_mask = numpy.zeros(self.n_vocab, dtype=bool)
        self.control_mask[list(self.control_tokens)] = True
        self._grammars_lock = threading.Lock()  # held for the dictionaries, never while converting
        self._converting: dict[Any, _Conversion] = {}  # grammars the Grammar thread is making
        self._converter: Optional[_CallThread] = None  # the Grammar thread, made on first use
        self.conversions = 0  # JSON schemas converted to grammars (once per distinct schema)
        self._lock = threading.Lock()
        self._sessions: list[tuple[LlamaSession, Optional[_ContextSize]]] = []  # each with its context's size
        self._wide: Optional[_CallThread] = None
        self._wide_lock = threading.Lock()  # held while a decode with borrowed threads runs
        # Saved states may be cut back only where every layer's cells can be (full attention).
        self.trimmable = not (L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model)
                              or L.llama_model_n_swa(self.model) > 0)
        self.store = StateStore.for_model(self, model_path, owner) if not self.embedding_only else None

    def meta(self, key: str) -> Optional[str]:
        """A GGUF metadata value as text, or None if the model has no such key."""
        size = 256
        while True:
            buf = self._char_array(size)
            count = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, size)
            if count < 0:
                return None
            if count < size:
                return buf.value.decode("utf-8", "replace")
            size = count + 1

    def decode_wide(self, ctx: Any, batch: Any) -> int:
        """``llama_decode`` on the runner's one thread for decodes with borrowed threads.

        llama.cpp's CPU threads come from OpenMP, and libgomp gives every OS thread that
        runs a multi-threaded decode a team of its own; once the teams together hold more
        threads than there are cores, it stops spinning at barriers in every team. Measured
        here: a 2-thread decode 20-30% slower once two worker threads had each run one.
        Running every such decode on this one thread keeps a single team.
        """
        with self._wide_lock:  # one borrower at a time
            if self._wide is None:
                self._wide = _CallThread("Wide")
            return self._wide.call(self.L.llama_decode, ctx, batch)

    def wait_wide(self) -> None:
        """Wait for a decode with borrowed threads in progress to end.

        A worker that has just got a job would otherwise decode beside it, one thread more
        than there are cores, and the borrowed decode's OpenMP barriers would keep waiting for
        a preempted thread (measured: a 12-token step 262 ms instead of about 40). Its lender
        gives the threads back at its next step, so this waits one step at most.
        """
        with self._wide_lock:
            pass

    def _chat_formatter(self) -> Any:
        """The model's chat template as a formatter, else FALLBACK_TEMPLATE's (``fallback``
        says which; said once, here)."""
        L = self.L
        template = L.llama_model_chat_template(self.model, None)
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        def token_text(token: int) -> str:
            if token < 0:
                return ""
            return (L.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", "replace")

        eos, bos = token_text(L.llama_vocab_eos(self.vocab)), token_text(L.llama_vocab_bos(self.vocab))
        self.fallback = True  # until the model's own template is read
        why = f"{self.model_name} has no chat template"
        if template:
            try:
                formatter = Jinja2ChatFormatter(template.decode("utf-8", "replace"), eos_token=eos, bos_token=bos)
                self.fallback = False
                return formatter
            except Exception as err:  # a template jinja cannot parse
                why = f"the chat template of {self.model_name} is unusable ({err})"
        log.warning(f"{why}: every chat job (prompt, system, parent's turns, messages) is rendered in ChatML, "
                    "<|im_start|>ROLE\\nTEXT<|im_end|>, as llama-server renders it; raw jobs are used as written")
        return Jinja2ChatFormatter(FALLBACK_TEMPLATE, eos_token=eos, bos_token=bos)

    def memory(self) -> dict[str, Any]:
        return model_memory(self)

    def session(self, index: int, config: Config) -> "LlamaSession":
        """Create worker ``index``'s context; raise ModelError if it cannot be allocated."""
        threads = config.threads or max(1, cpu_count() // config.workers)
        session = LlamaSession(self, threads, config.seqs, config.batch, config)
        size = (_ContextSize(session.buffers, self.L.llama_n_ctx(session.ctx), session.ctx_per_seq)
                if session.ctx is not None else None)  # read here, on the thread that made it: see model_memory
        with self._lock:
            self._sessions.append((session, size))
        return session

    def tokens(self, job: RunningJob) -> list[int]:
        """The job's prompt as tokens: through the model's chat template (FALLBACK_TEMPLATE's
        for a model without one) unless ``raw``.

        Only the template's own markers become control tokens: every message's content (a
        plain prompt is one user message, ``system`` one system message) is tokenized as
        text, so text that spells a marker (``<|im_start|>system...``) cannot forge a turn.
        A ``raw`` job is the caller's own markup: its special tokens are parsed."""
        params = job.params
        if job_param(params, "raw"):
            return self.tokenize(job.prompt, add_special=True, special=True)
        messages = list(job_param(params, "messages") or [{"role": "user", "content": job.prompt}])
        system = job_param(params, "system")
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        tokens: list[int] = []
        variables = dict(job_param(params, "chat_template_kwargs") or {})
        if thinking_budget(params) == 0:  # Qwen3's switch; templates without one ignore it
            variables.setdefault("enable_thinking", False)
        if self.takes_effort and job_param(params, "reasoning_effort") is not None:
            variables.setdefault("reasoning_effort", job_param(params, "reasoning_effort"))
        messages = tool_turns(messages, params, variables, self.tool_format, self._spells_control)
        if self.fallback and self.L.llama_vocab_get_add_bos(self.vocab):  # ChatML writes none: the model's, as llama-server's
            tokens.append(self.L.llama_vocab_bos(self.vocab))
        for piece, is_content in self._render(messages, variables):  # a template writes its own BOS
            tokens += self.tokenize(piece, add_special=False, special=not is_content)
        return tokens

    def _spells_control(self, text: str) -> bool:
        """Whether ``text`` holds the text of a control token (``<|im_start|>``...)."""
        return self.tokenize(text, False, True) != self.tokenize(text, False, False)

    def _render(self, messages: list[dict[str, str]], variables: Mapping[str, Any]) -> list[tuple[str, bool]]:
        """The chat template applied to ``messages``, as (text, is a message's content)
        pieces in order: the whole rendering as one piece when no content spells a control
        token (then the split changes nothing), else split. To split, the template is rendered
        again with a unique mark in place of each content to find its own text around them;
        the marks replaced by the contents (as given, or stripped, for templates that trim
        them) must give the real rendering. ``variables``: the job's chat_template_kwargs."""
        try:
            text = self._formatter(messages=messages, **variables).prompt
            if not any(self._spells_control(m["content"]) for m in messages):
                # The common case: one call, the very tokens of the whole rendering. (Each
                # call of llama_tokenize starts a new word: a SentencePiece vocabulary adds its
                # space prefix, so splitting an innocent prompt would change its tokens.)
                return [(text, False)]
            marks = [f"\ue000{i}\ue001" if m["content"] else "" for i, m in enumerate(messages)]
            marked = self._formatter(messages=[dict(m, content=mark) for m, mark in zip(messages, marks)], **variables).prompt
        except JobError:
            raise
        except Exception as err:
            raise JobError("bad_request", f"chat template failed: {err}") from None
        around: Optional[list[str]] = []  # the template's text before each mark, and after the last
        rest = marked
        for mark in marks:
            if not mark:  # an empty content: nothing to find, nothing to keep apart
                around.append("")
                continue
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                around = None  # the template dropped or repeated a content: not separable this way
                break
            around.append(before)
        if around is not None:
            for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
                if "".join(t + c for t, c in zip(around, contents)) + rest == text:
                    pieces = [piece for t, c in zip(around, contents) for piece in ((t, False), (c, True))]
                    return [(t, is_content) for t, is_content in pieces + [(rest, False)] if t]
        raise JobError("bad_request", "a message spells a control token, and the chat template changes "
                                      "message contents in a way nrvna cannot keep apart from its own markup")

    def tokenize(self, text: str, add_special: bool, special: bool) -> list[int]:
        """``text`` as tokens; ``special``: control-token text (``<|im_end|>``) becomes the
        control token, else it stays text; ``add_special``: BOS first if the model wants one."""
        L = self.L
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (L.llama_token * capacity)()
            count = L.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, special)
            if count >= 0:
                return list(buf[:count])
            capacity = -count

    def piece(self, token: int) -> bytes:
        """A token's bytes (cached: the same few thousand tokens recur)."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = self._token_text(token, special=False)
        return cached

    def give_text(self, token: int) -> None:
        """Pieces of control ``token`` are its own text from now on (a thinking block's tag that
        is one control token: rendered empty, it could not be matched in text)."""
        self._pieces[token] = self._token_text(token, special=True)

    def has_grammar(self, params: Mapping[str, Any]) -> bool:
        """Whether a job with ``params`` is constrained by a grammar or a JSON schema."""
        return grammar_key(params, self.tool_format) is not None

    def _token_text(self, token: int, special: bool) -> bytes:
        """A token's bytes; ``special``: a control token's own text too (else nothing)."""
        size = 64
        while True:
            buf = self._char_array(size)
            count = self.L.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if count >= 0:
                return bytes(buf[:count])
            size = -count

    @staticmethod
    def _char_array(size: int) -> Any:
        import ctypes

        return (ctypes.c_char * size)()

    def penalty(self, params: Mapping[str, Any]) -> Optional["_Penalties"]:
        """The job's penalties and logit biases (None if all are off): applied to the logits
        before its sampler chain runs (see _Penalties)."""
        repeat = job_param(params, "repeat_penalty", self.config)
        frequency = job_param(params, "frequency_penalty", self.config)
        presence = job_param(params, "presence_penalty", self.config)
        bias = {int(token): value for token, value in (job_param(params, "logit_bias") or {}).items()}
        for token in bias:
            if token >= self.n_vocab:
                raise JobError("bad_request", f"logit_bias: token {token} is not in the model's vocabulary "
                                              f"(IDs 0 to {self.n_vocab - 1})")
        if (repeat == 1.0 or repeat <= 0) and not frequency and not presence and not bias:
            return None
        return _Penalties(self.np, repeat, frequency, presence, bias)

    def grammar(self, params: Mapping[str, Any]) -> Optional[tuple[Any, str, GrammarShape]]:
        """The job's grammar, if its output is constrained: (a key naming it, its GBNF text,
        its shape). A JSON schema is converted once per distinct schema, then found here again
        (here, on the calling thread, if no conversion of it is done: see prepare_grammar).
        Raises JobError (grammar_error) for one whose start is past the work limits."""
        named = grammar_key(params, self.tool_format)
        if named is None:
            return None
        kind, key, params = named
        with self._grammars_lock:
            found = self._grammars.pop(key, None)
            if found is not None:
                self._grammars[key] = found  # most recently used last
                return (key,) + found
        found = self._made(kind, params)
        self._remember(key, found)
        return (key,) + found

    def prepare_grammar(self, params: Mapping[str, Any]) -> Optional[_Conversion]:
        """None when the job's grammar is made (or it has none); otherwise its conversion,
        begun now on the runner's Grammar thread or joined there, for a session to wait for
        while its other sequences go on stepping: a schema's conversion and check take up
        to the counted work its submit allows (SCHEMA_MAX_PATTERN_WORK), and no decode waits
        for them."""
        named = grammar_key(params, self.tool_format)
        if named is None or _small_grammar(named[1]):
            return None
        kind, key, params = named
        with self._grammars_lock:
            if key in self._grammars:
                return None
            conversion = self._converting.get(key)
            if conversion is None:
                conversion = self._converting[key] = _Conversion()
                if self._converter is None:
                    self._converter = _CallThread("Grammar")
                self._converter.post(self._convert, kind, key, params, conversion)
        return conversion

    def _convert(self, kind: str, key: Any, params: Mapping[str, Any], conversion: _Conversion) -> None:
        """The Grammar thread's call: make the grammar, remember it, and tell who waits."""
        found: Optional[tuple[str, GrammarShape]] = None
        try:
            found = self._made(kind, params)
            conversion.found = (key,) + found
        except JobError as err:
            conversion.error = err
        except Exception as err:  # a check's own bug fails the jobs that wait, never the thread
            conversion.error = JobError("runner_error", f"runner failed: {err!r}")
        finally:
            self._remember(key, found)
            conversion.done.set()

    def _made(self, kind: str, params: Mapping[str, Any]) -> tuple[str, GrammarShape]:
        """A grammar's GBNF and shape, made (no lock held: it takes what the schema's counted
        work allows). Raises JobError."""
        text = self._make_grammar(kind, params)
        try:
            return text, check_grammar(text)
        except InvalidInput as err:  # a converted schema's grammar, past the work limits
            raise JobError("grammar_error", str(err)) from None

    def _remember(self, key: Any, found: Optional[tuple[str, GrammarShape]]) -> None:
        """Keep a grammar made (None: its conversion failed), as the most recently used."""
        with self._grammars_lock:
            self._converting.pop(key, None)
            if found is None:
                return
            self._grammars.pop(key, None)
            self._grammars[key] = found
            if len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.pop(next(iter(self._grammars)))

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as the grammar sees it, for GrammarShape.vocab_cost (made once)."""
        if self._grammar_vocab is not None:  # (every redraw asks: no lock once it is made)
            return self._grammar_vocab
        with self._grammars_lock:
            if self._grammar_vocab is None:
                L = self.L
                pieces = [b"" if L.llama_vocab_is_eog(self.vocab, t) else self.piece(t) for t in range(self.n_vocab)]
                self._grammar_vocab = GrammarVocab(self.np, pieces)
        return self._grammar_vocab

    def _make_grammar(self, kind: str, params: Mapping[str, Any]) -> str:
        """The GBNF of a grammar job, or its schema converted. (The checks ran at claim: the
        Processor validates params.json, a hand-made one too, with the submit's checks.)"""
        if kind not in ("json_schema", "tools"):
            return job_param(params, "grammar")
        try:
            if kind == "tools":
                choice, parallel, form = tool_choice(params), parallel_calls(params), self.tool_format
                schema = tool_call_schema(job_param(params, "tools"), choice, parallel, form)
                text = (schema_to_grammar(schema) if form.generic else
                        tool_grammar(schema_to_grammar(schema, "tool-call"), "tool-call", choice, parallel, form))
            else:
                text = schema_to_grammar(job_param(params, "response_format")["json_schema"]["schema"])
        except Exception as err:  # the converter's own assertions: a gap in check_json_schema
            raise JobError("bad_request", f"{'tools' if kind == 'tools' else 'response_format'}: the schema could not be converted: {err!r}") from None
        with self._grammars_lock:  # workers and the Grammar thread convert at once
            self.conversions += 1
        return text

    def sampler(self, params: Mapping[str, Any]) -> Any:
        """A sampler chain for one job (chains hold state: one per sequence); the
        repetition penalty is not in it (see ``penalty``)."""
        L, cfg = self.L, self.config
        temperature = job_param(params, "temperature", cfg)
        top_k = job_param(params, "top_k", cfg)
        top_p = job_param(params, "top_p", cfg)
        min_p = job_param(params, "min_p", cfg)
        seed = job_param(params, "seed", cfg) or L.LLAMA_DEFAULT_SEED  # 0 = random
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if top_k > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(min_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
        return chain

    def close(self) -> None:
        """Free every context, then the model."""
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session, _ in sessions:
            session.close()
        if self._wide is not None:
            self._wide.close()
            self._wide = None
        if self._converter is not None:  # a conversion under way is abandoned, not waited for
            self._converter.close(wait=False)
            self._converter = None
        if self.store is not None:
            self.store.close()
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None


##############################################################################
# 12. Daemon: the threads that work the queue, and the Server that runs them
##############################################################################
# Owns the daemon's threads (Scanner, workers, Finisher, Watcher, Models, Hooks) and the Server
# that starts and stops them. Invariant: one thread of one daemon holds a job at a time, and every
# change of state is a section 7 move. Each class's "Threads:" line says who calls it.


DAEMON_STATUS_SECONDS = 2.0  # how often a daemon's record (daemons/<name>.json) is rewritten
WATCH_SECONDS = 0.1  # how often running jobs are checked for cancel/timeout and partial.txt flushed
# Ended jobs a worker leaves to the Finisher thread at most; past that it finishes its own (see Server._work_loop).
FINISH_BACKLOG = 64
REAP_SECONDS = 0.5  # how often a daemon looks for daemons that died (their running jobs are requeued)
ORPHAN_SECONDS = 30.0  # how often it also requeues any job in processing/ that nobody holds
STALE_STAGING_SECONDS = 3600  # input/writing/* older than this is a dead client's leftover
CREATE_GRACE_SECONDS = 1.0  # a dir mkdir'ed straight into ready/ gets this long to fill up


# ============================================================================
# 12.1 The queue: Pool and Scanner
# ============================================================================
# Pool: a heap per model's queue, priority first, each ID given out once; Scanner: finds ready jobs
# by inotify, listing only at start and after an overflow. Invariant: a job is queued at most once
# while this daemon queues or holds it.


# Where a queued job goes: its priority and its model's queue (the model's index in
# _Models.served); ``parent``: the unfinished job it waits for (None: it may run now).
_Place = namedtuple("_Place", "priority queue parent", defaults=(None,))


# A model's queue as the Models thread sees it: how many jobs, the top priority, and the order
# key of the job ``Pool.get`` takes next (the oldest of that priority).
_QueueHead = namedtuple("_QueueHead", "jobs top next_key")


class Scanner:
    """Finds jobs in input/ready/ and hands them to the Pool.

    On Linux it is told by inotify: a published job is queued within a millisecond and an
    idle daemon sleeps in select(). The directory is listed only at start and after an event
    overflow, so a 100k backlog is never rescanned. Elsewhere it stats the directory every
    20 ms and lists it when its mtime changed, and once a second regardless (mtime is coarse).

    Threads: its own (the Scanner), which alone touches the watch and ``_deferred``; the
    main thread calls ``wake`` (a pipe) and, at a drain, ``scan`` (the Pool locks itself;
    ``scans`` is only ever compared with 0, and the main thread scans only once it is not).
    """

    def __init__(self, workspace: str, pool: Pool, stop: threading.Event) -> None:
        self.ready = os.path.join(workspace, READY)
        self.pool = pool
        self.stop = stop
        self.scans = 0
        self._wake_r, self._wake_w = os.pipe()
        self._deferred: dict[str, float] = {}
        try:
            self.watch: Optional[_DirWatch] = _DirWatch(self.ready)
        except (OSError, AttributeError) as err:
            log.debug(f"inotify unavailable ({err}); polling input/ready/")
            self.watch = None

    def scan(self) -> int:
        """List input/ready/ and queue what is new; return how many were new."""
        with os.scandir(self.ready) as entries:
            names = [e.name for e in entries if not e.name.startswith(".")]
        self.scans += 1
        added = self.pool.push(names)
        if added:
            log.debug(f"Found {added} ready jobs")
        return added

    def run(self) -> None:
        """The Scanner thread's loop; returns when ``stop`` is set."""
        _name_os_thread("Scanner")
        try:
            self.scan()
            if self.watch is not None:
                self._watch_loop(self.watch)
            else:
                self._poll_loop()
        except Exception as err:  # the daemon cannot work without discovery: stop it
            log.error(f"scanner failed: {err!r}; shutting down")
            self.stop.set()
            self.pool.close()
        finally:
            if self.watch is not None:
                self.watch.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        log.debug("Scanner thread exiting")

    def _watch_loop(self, watch: _DirWatch) -> None:
        import select

        while not self.stop.is_set():
            timeout = None
            if self._deferred:
                timeout = max(0.0, min(self._deferred.values()) - time.monotonic())
            readable, _, _ = select.select([watch, self._wake_r], [], [], timeout)
            if watch in readable:
                events, overflow = watch.read()
                moved = [name for mask, name in events if mask & watch.IN_MOVED_TO and not name.startswith(".")]
                for mask, name in events:
                    if mask & watch.IN_CREATE and not name.startswith("."):
                        # mkdir'ed in place rather than renamed in: give its writer a moment
                        self._deferred[name] = time.monotonic() + CREATE_GRACE_SECONDS
                if moved and self.pool.push(moved):
                    log.trace(f"Queued {len(moved)} published jobs")
                if overflow:
                    log.warning("inotify queue overflowed; rescanning input/ready/")
                    self.scan()
            self._release_deferred()

    def _release_deferred(self) -> None:
        now = time.monotonic()
        due = [name for name, when in self._deferred.items() if when <= now]
        for name in due:
            del self._deferred[name]
        if due:
            self.pool.push(n for n in due if os.path.lexists(os.path.join(self.ready, n)))

    def _poll_loop(self) -> None:
        last_mtime, last_scan = -1, 0.0
        while not self.stop.wait(0.02):
            try:
                mtime = os.stat(self.ready).st_mtime_ns
            except OSError:
                continue
            if mtime != last_mtime or time.monotonic() - last_scan >= 1.0:
                last_mtime, last_scan = mtime, time.monotonic()
                self.scan()

    def wake(self) -> None:
        """Make the loop notice ``stop`` now."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass


class Pool:
    """The queue between the Scanner and the workers: a heap per model (the model's queue,
    keyed by its index in _Models.served), each by priority (higher first), then submission
    order. Workers take from the active model's queue only (``active``; None while the
    daemon switches models).

    ``known`` holds every ID queued or being worked on, so a job is never queued twice
    (the spec's scanner re-submitted every queued job every second: unbounded growth), and
    the IDs of jobs for a model this daemon does not serve (``elsewhere``), read once, and
    of children whose parent has not finished (``waiting``, by parent): a parent's end
    (``released``) routes its children again; no worker or poll is spent on them.

    Threads: the Scanner pushes, the workers get and end jobs, the Models thread reads the
    queues' heads and switches the active queue, the Watcher reroutes and forgets. Every
    field is read and written under ``_cond``'s lock, and ``route`` is called under it
    (its routing is changed under it too: see ``reroute``); ``on_queued`` is called
    outside it.
    """

    def __init__(self, route: Callable[[str], Optional[_Place]] = lambda job_id: _Place(0, 0),
                 on_queued: Callable[[int, int], None] = lambda priority, queue: None) -> None:
        self._cond = threading.Condition()
        self._heaps: dict[int, list[tuple[int, tuple[int, int, int, str], str]]] = {}
        # A queued job's _Place, read when it is pushed; None: served elsewhere.
        self._route = route
        self.elsewhere: set[str] = set()
        self.waiting: dict[str, set[str]] = {}  # parent -> its children queued here
        self._on_queued = on_queued  # told the highest priority of each push, per queue
        self._later: list[tuple[float, str, int, int]] = []  # (when, id, priority, queue): handed back for now
        self._known: set[str] = set()
        self._taken: dict[str, _Place] = {}  # where each job a worker took was queued
        self._busy = 0
        self._closed = False
        self.active: Optional[int] = 0  # the queue ``get`` takes from
        self._waiting: set[int] = set()  # idle workers blocked in get()
        self._favored: Optional[int] = None  # the worker whose job ended last
        self._resting = False  # the favored worker has nothing running and is on its way back to get

    def push(self, job_ids: Iterable[str]) -> int:
        """Queue the IDs not already queued or running; return how many were new."""
        added, highest = 0, {}
        with self._cond:
            for job_id in job_ids:
                if job_id not in self._known:
                    self._known.add(job_id)
                    route = self._route(job_id)
                    if route is None:
                        self.elsewhere.add(job_id)
                        continue
                    priority, queue, parent = route
                    if parent is not None:
                        self.waiting.setdefault(parent, set()).add(job_id)
                        continue
                    self._put(job_id, priority, queue)
                    highest[queue] = max(highest.get(queue, priority), priority)
                    added += 1
            if added:
                self._cond.notify(added)
        for queue, priority in highest.items():
            self._on_queued(priority, queue)
        return added

    def reroute(self, change: Callable[[], bool]) -> None:
        """Route the jobs left for other daemons again if ``change()``, called under the
        pool's lock (the routing it changes is read under it), says the routes changed."""
        with self._cond:
            if not change():
                return
            again, self.elsewhere = self.elsewhere, set()
            self._known -= again
        self.push(again)

    def released(self, parent: str) -> None:
        """``parent`` ended (done or failed): route its waiting children again (a failed
        parent's fail at their claim, parent_failed)."""
        with self._cond:
            children = self.waiting.pop(parent, set())
            self._known -= children
        if children:
            self.push(children)

    def release_finished(self, unfinished: Callable[[str], bool]) -> None:
        """Release the children of every parent no longer ``unfinished`` (ended in another
        daemon, cancelled, or gone): the Watcher's periodic pass."""
        with self._cond:
            parents = list(self.waiting)
        for parent in parents:
            if not unfinished(parent):
                self.released(parent)

    def wait_for(self, job_id: str, parent: str) -> None:
        """A worker's claim found ``job_id``'s parent unfinished again: it waits for it."""
        with self._cond:
            self._busy -= 1
            self._taken.pop(job_id, None)
            self.waiting.setdefault(parent, set()).add(job_id)
            self._cond.notify_all()

    def waiting_children(self) -> set[str]:
        with self._cond:
            return set().union(*self.waiting.values())

    def _put(self, job_id: str, priority: int, queue: int) -> None:
        heapq.heappush(self._heaps.setdefault(queue, []), (-priority, order_key(job_id), job_id))

    def top_priority(self, queue: Optional[int] = None) -> Optional[int]:
        """The priority of the job ``get`` would return next (from ``queue``, by default the
        active one); None if none is queued."""
        with self._cond:
            heap = self._heaps.get(self.active if queue is None else queue)
            return -heap[0][0] if heap else None

    def heads(self) -> dict[int, _QueueHead]:
        """Every model's queue with jobs queued, by its head (_QueueHead). The heads only:
        the Models thread asks every 0.1 s, whatever the backlog."""
        with self._cond:
            return {queue: _QueueHead(len(heap), -heap[0][0], heap[0][1])
                    for queue, heap in self._heaps.items() if heap}

    def set_active(self, queue: Optional[int]) -> None:
        """Make ``queue`` the one ``get`` takes from (None: none, while models switch)."""
        with self._cond:
            self.active = queue
            self._cond.notify_all()

    def get(self, timeout: float, worker: Optional[int] = None, above: Optional[int] = None) -> Optional[str]:
        """The first queued ID of the active queue (highest priority, then oldest), waiting up
        to ``timeout`` s; None if none, closed, or the models are switching. With ``above``,
        only a job of a higher priority than that.

        A lone queued job is left to the worker whose job ended last while that worker
        waits here idle: its context still holds that job's cells, which a conversation's
        next turn or a retry starts with (any idle worker would do otherwise, and waiters
        are woken oldest first, so a conversation's turns would wander between workers).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if worker is not None and worker == self._favored:
                self._resting = False  # here now: _waiting says whether it waits
            while not self._closed and self.active is not None:
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    _, job_id, priority, queue = heapq.heappop(self._later)
                    self._put(job_id, priority, queue)
                heap = self._heaps.get(self.active)
                if heap and (above is None or -heap[0][0] > above):
                    if not self._leave_to_favored(worker, heap):
                        self._busy += 1
                        priority, _, job_id = heapq.heappop(heap)
                        self._taken[job_id] = _Place(-priority, self.active)
                        return job_id
                    self._cond.notify_all()  # the favored worker takes it
                left = deadline - now
                if left <= 0:
                    return None
                if self._later:
                    left = min(left, self._later[0][0] - now)
                if worker is not None:
                    self._waiting.add(worker)
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting.discard(worker)
        return None

    def _leave_to_favored(self, worker: Optional[int], heap: list[Any]) -> bool:
        favored = self._favored
        return (worker is not None and favored is not None and favored != worker
                and len(heap) == 1 and (favored in self._waiting or self._resting))

    def favor(self, worker: int, resting: bool = False) -> None:
        """``worker``'s job is the one that ended last (see ``get``); ``resting``: it runs no
        other job and comes back to ``get`` once it has copied its ended contexts out for saving
        (LlamaSession.save_ended): a lone job waits for it meanwhile."""
        with self._cond:
            self._favored, self._resting = worker, resting

    def done(self, job_id: str) -> None:
        """The worker is finished with ``job_id`` (ended, lost a claim race, or requeued)."""
        with self._cond:
            self._known.discard(job_id)
            self._taken.pop(job_id, None)
            self._busy -= 1
            self._cond.notify_all()

    def retry_later(self, job_id: str, delay: float) -> None:
        """Queue ``job_id`` again after ``delay`` s, in its queue (handed back after an I/O
        error, or held by another claimer for now)."""
        with self._cond:
            self._busy -= 1
            priority, queue, _ = self._taken.pop(job_id, _Place(0, self.active or 0))
            heapq.heappush(self._later, (time.monotonic() + delay, job_id, priority, queue))
            self._cond.notify()

    def close(self) -> None:
        """Wake every waiting worker; ``get`` returns None from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def idle(self) -> bool:
        """Nothing queued, waiting or being worked on."""
        with self._cond:
            return not any(self._heaps.values()) and not self._later and self._busy == 0

    def running(self) -> int:
        """How many jobs workers have taken and not yet ended."""
        with self._cond:
            return self._busy

    def take_queue(self, queue: int) -> list[str]:
        """Take every job of the model's ``queue`` as workers take them (each then ends with
        ``done`` or ``retry_later``): the jobs of a model that cannot be loaded, to fail them."""
        with self._cond:
            heap = sorted(self._heaps.pop(queue, []))
            for priority, _, job_id in heap:
                self._taken[job_id] = _Place(-priority, queue)
            self._busy += len(heap)
            return [entry[2] for entry in heap]

    def set_aside(self, queue: int) -> None:
        """``queue``'s model cannot be loaded: its jobs are left for another daemon."""
        with self._cond:
            self.elsewhere.update(entry[2] for entry in self._heaps.pop(queue, []))

    def forget_gone(self, present: set[str]) -> None:
        """Forget the jobs left for other daemons that are no longer in ready/ (``present``):
        other daemons ran them."""
        with self._cond:
            gone = self.elsewhere - present
            self.elsewhere -= gone
            self._known -= gone
            for parent, children in list(self.waiting.items()):  # cancelled while waiting
                self._known -= children - present
                children &= present
                if not children:
                    del self.waiting[parent]

    def __len__(self) -> int:
        """Jobs queued in the active queue, and handed back ones."""
        with self._cond:
            return len(self._heaps.get(self.active, ())) + len(self._later)


# ============================================================================
# 12.2 Claims and finishes: Processor
# ============================================================================
# Processor claims a job (a rename into processing/ under its lock), finishes it (every file
# written and fsynced, then the move) or hands it back (_HandBacks; uncounted on a full disk).
# Invariant: a job ends once; a crash at any step leaves it in processing/ for recovery.


# Bytes counted per file on top of its data when a finish's need for room is reckoned: a
# block (and a directory entry) each; a result is not generated again until that much is free.
ROOM_SLACK = 4096


class _HandBack(Exception):
    """A job could not be claimed or finished because of an I/O error; it is back in ready/.

    Threads: raised to, and caught by, the thread that claims the job."""


class _Busy(Exception):
    """A job could not be claimed now: another claimer holds it, or a requeue still does.

    Threads: raised to, and caught by, the thread that claims the job."""


class _ParentWaits(Exception):
    """A claimed job's parent is queued or running again (a retry since it was routed): the
    job was handed back unchanged, to wait for it (``parent``).

    Threads: raised to, and caught by, the thread that claims the job."""

    def __init__(self, job_id: str, parent: str) -> None:
        super().__init__(job_id)
        self.parent = parent


class _Claim:
    """The daemon's hold on a running job (runners never see it): its open directory, where it
    is, its meta.json as the claim wrote it, and the lock the worker finishing it and the
    partial.txt flusher share.

    Threads: the thread that holds the job (it claimed it, or a recovery did) reads and
    writes every field; the Watcher uses ``dir_fd`` only under ``lock``, and not once
    ``closed`` (set under ``lock`` before the holder closes ``dir_fd``)."""

    __slots__ = ("dir_fd", "meta", "path", "lock", "closed", "before", "kept", "cancel_dropped")

    def __init__(self, dir_fd: int, meta: dict[str, Any], path: str, before: dict[str, Any],
                 kept: str = "") -> None:
        self.dir_fd, self.meta, self.path = dir_fd, meta, path
        self.lock = threading.Lock()
        self.closed = False
        # What a hand-back restores: meta.json as the claim found it (``kept``: "link", also
        # on disk as CLAIMED_META; "none", it had none; "", in memory only), and a cancel
        # request the finish removed (``cancel_dropped``).
        self.before, self.kept, self.cancel_dropped = before, kept, False


def _unlinked(name: str, dir_fd: int) -> bool:
    """Remove ``name`` if it is there; whether it was."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _int_field(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _write_key(job_id: str, before: Mapping[str, Any]) -> tuple[str, int]:
    """The key of a job's failed finishes in a daemon's memory: its ID and how often `nrvna
    retry` sent it back (a retry starts the count afresh, as it does in meta.json)."""
    return job_id, _int_field(before, "retries")


def _disk_size(path: str) -> int:
    """The size of the filesystem holding ``path``, in bytes (unknown: as large as any result)."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return sys.maxsize
    return fs.f_blocks * fs.f_frsize


def _link_claimed_meta(dir_fd: int) -> str:
    """Keep meta.json as the claim finds it under CLAIMED_META (a hard link: no space
    needed): "link"; "none" where the job has no meta.json yet (a hand-back removes the
    claim's); "" where the filesystem makes no links (a hand-back writes it from memory)."""
    for _ in range(2):
        try:
            os.link(META_FILE, CLAIMED_META, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            return "link"
        except FileNotFoundError:
            return "none"
        except FileExistsError:  # left by a hand-back that could not remove it
            _unlink_quietly(CLAIMED_META, dir_fd)
        except OSError:
            return ""
    return ""


class _HandBacks:
    """Hands back to ready/ a job whose claim or finish met an I/O error, as it was claimed
    (its attempt uncounted), and remembers in this daemon what the job's next claim must
    know: its failed finishes (meta.json holds them too, but a full disk may not take them)
    and, for a result that met a full disk, the room it waits for.

    Threads: called by whichever thread claims or finishes a job (the workers, the Finisher,
    the Models thread failing an unloadable model's jobs, the Watcher's and the start's
    recoveries), each on a job it holds (see Processor); the memory of failed finishes and
    room is shared by them all, under ``_lock``.
    """

    def __init__(self, workspace: str, config: Config) -> None:
        self.workspace, self.config = workspace, config
        self._lock = threading.Lock()
        # Failed finishes (count, last error) by job (see _write_key).
        self._write_failures: dict[tuple[str, int], tuple[int, str]] = {}
        # Jobs handed back because the disk was full, with the bytes their finish needed: not
        # claimed (not generated again) until the filesystem has that much free (has_room).
        self._room_needed: dict[str, int] = {}

    def check_room(self, job_id: str) -> None:
        """Raise _HandBack while ``job_id``, handed back for a full disk, has no room yet."""
        with self._lock:
            needed = self._room_needed.get(job_id)
        if needed is None:
            return
        if not self.has_room(needed):
            log.limited("room", f"the disk holding {self.workspace} is full: jobs wait in input/ready/ until "
                        f"there is room for their results ({job_id} needs {needed:,} bytes); none is generated "
                        "again before that, and no attempt or write failure is counted", level="warning")
            raise _HandBack(job_id)
        with self._lock:
            del self._room_needed[job_id]

    def finished(self, job_id: str, before: dict[str, Any]) -> None:
        """``job_id`` ended: forget its failed finishes."""
        with self._lock:
            self._write_failures.pop(_write_key(job_id, before), None)

    def cannot_finish(self, job_id: str, claim: _Claim, err: OSError, needed: int) -> bool:
        """A finish that needed ``needed`` bytes failed with an I/O error: hand the job back
        as it was claimed, its attempt uncounted. The files the finish wrote go first (that
        frees the space the rest needs), then meta.json is put back (restore_meta).

        A full disk (ENOSPC, for a result that fits the filesystem at all) fails no job: the
        job waits in ready/, not generated again until there is room for it (has_room). Any
        other failure (EIO, EFBIG past a file size limit, EDQUOT, a result larger than the
        whole filesystem) is counted (``write_failures``; in memory too, where that cannot be
        written): the claim after NRVNA_MAX_WRITE_TRIES of them fails the job with
        write_error, unrun. Returns True when the job had moved on after all (the move
        happened, an fsync after it failed): it ended, and nothing is undone."""
        reason = _os_error(err)
        dir_fd = claim.dir_fd
        if not _same_entry(dir_fd, job_path(self.workspace, PROCESSING, job_id)):
            log.error(f"{job_id} ended, but making its move durable failed: {reason}")
            return True
        _clear_outputs(dir_fd, keep=(CLAIMED_META,))
        if err.errno == errno.ENOSPC and needed <= _disk_size(self.workspace):
            return self._wait_for_room(job_id, claim, reason, needed)
        failures = self._count_write_failure(job_id, claim.before, reason)
        self._put_back_cancel(claim)
        meta = dict(claim.before, write_failures=failures, last_write_error=reason,
                    events=claim.meta.get("events") or [])
        record_event(meta, Status.Running, "requeued", "write_error")
        self.restore_meta(job_id, claim, meta)
        log.limited(f"finish:{err.errno}", f"cannot finish {job_id}: {reason}; handed it back to the queue "
                    f"(failed finish {failures} of NRVNA_MAX_WRITE_TRIES={self.config.max_write_tries}; "
                    "no attempt counted)")
        self.hand_back(job_id)
        return False

    def _wait_for_room(self, job_id: str, claim: _Claim, reason: str, needed: int) -> bool:
        """Hand back a job whose result did not fit a full disk, uncounted: it is claimed again
        once the filesystem has ``needed`` bytes free (in this daemon's memory; another daemon
        that claims it meanwhile learns the same by one failed finish)."""
        with self._lock:
            self._room_needed[job_id] = needed
        self._put_back_cancel(claim)
        meta = dict(claim.before, events=claim.meta.get("events") or [])
        record_event(meta, Status.Running, "requeued", "no_space")
        self.restore_meta(job_id, claim, meta)
        log.limited("finish:no space", f"cannot finish {job_id}: {reason}; handed it back to the queue, where it "
                    f"waits for {needed:,} bytes of room (no attempt and no write failure counted)")
        self.hand_back(job_id)
        return False

    @staticmethod
    def _put_back_cancel(claim: _Claim) -> None:
        """A cancel request the failed finish removed stands: the next claim fails the job unrun."""
        if claim.cancel_dropped:
            try:
                write_file(claim.dir_fd, CANCEL_FILE, b"cancelled by nrvna cancel while its result was being written\n")
            except OSError:
                pass  # the disk is that full: the job runs again, and a new cancel stops it

    def has_room(self, needed: int) -> bool:
        """Whether the workspace's filesystem has ``needed`` bytes and a few inodes free."""
        try:
            fs = os.statvfs(self.workspace)
        except OSError:
            return True  # unknown: try, as before
        return fs.f_bavail * fs.f_frsize >= needed and (fs.f_files == 0 or fs.f_favail >= 16)

    def _count_write_failure(self, job_id: str, before: dict[str, Any], reason: str) -> int:
        """Count one more failed finish of ``job_id``, in memory; return the count so far."""
        key = _write_key(job_id, before)
        with self._lock:
            failures = max(_int_field(before, "write_failures"), self._write_failures.get(key, (0, ""))[0]) + 1
            self._write_failures[key] = (failures, reason)
        return failures

    def check_write_failures(self, job_id: str, before: dict[str, Any]) -> None:
        """Raise write_error once NRVNA_MAX_WRITE_TRIES finishes of ``job_id`` have failed (as
        meta.json says, or, where its count could not be written, this daemon remembers)."""
        with self._lock:
            failures, reason = self._write_failures.get(_write_key(job_id, before), (0, ""))
        if _int_field(before, "write_failures") >= failures:
            failures, reason = _int_field(before, "write_failures"), str(before.get("last_write_error") or "")
        if failures >= self.config.max_write_tries:
            raise JobError("write_error", f"its result could not be written {failures} times "
                           f"(NRVNA_MAX_WRITE_TRIES={self.config.max_write_tries}); the last error: "
                           f"{reason or 'unknown'}; it is not retried again")

    def restore_meta(self, job_id: str, claim: _Claim, meta: Optional[dict[str, Any]] = None) -> None:
        """Put meta.json back as the claim found it, so that a hand-back counts no attempt, or
        as ``meta`` (that, with a count and the events of the attempt). First what needs no
        free space: the claim's hard link is renamed back, or, where the job had no
        meta.json, the claim's is removed. Then ``meta`` is written, or, where the
        filesystem made no link, the claim's: on a full disk that may fail (the count then
        lives on in memory only, and the events miss the attempt).

        If neither works (an I/O error: a rename needs no space), meta.json keeps the
        claim's count, one attempt too many, and the job goes back to the queue all the same:
        an attempt too many can at worst fail it a death early (crash_ceiling), while a job
        left in processing/ would wait for a recovery and count that attempt anyway."""
        dir_fd, failure = claim.dir_fd, None
        restored = False
        try:
            if claim.kept == "link":
                os.rename(CLAIMED_META, META_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                restored = True
            elif claim.kept == "none":  # it had no meta.json (as submitted)
                restored = True
                os.unlink(META_FILE, dir_fd=dir_fd)
        except FileNotFoundError:
            pass  # the claim failed before its meta.json
        except OSError as err:
            restored = False
            failure = err
        if claim.kept == "link":
            _unlink_quietly(CLAIMED_META, dir_fd)  # a rename between two names of one file does nothing
        claim.kept = ""
        if meta is not None or not restored:
            try:
                write_file(dir_fd, META_FILE, dump_meta(claim.before if meta is None else meta))
                restored = True
            except OSError as err:
                failure = failure if restored else err
        try:
            os.fsync(dir_fd)
        except OSError as err:
            restored, failure = False, err
        if not restored and failure is not None:
            log.limited(f"restore:{failure.errno}", f"cannot put {job_id}'s meta.json back as claimed "
                        f"({_os_error(failure)}); it goes back to the queue, perhaps with its attempt counted")

    def hand_back(self, job_id: str) -> None:
        """Put a job whose claim or finish hit an I/O error back in ready/ (as it was claimed:
        see cannot_finish and restore_meta)."""
        try:
            move_job(self.workspace, job_id, PROCESSING, READY)
        except OSError as err:
            log.limited(f"hand back:{err.errno}", f"cannot hand {job_id} back ({_os_error(err)}); it stays in "
                        "processing/ until a recovery requeues it (within 30 s)")


class Processor:
    """Moves jobs through their states.

    Durability: files are fsynced inside the job dir, the job dir is fsynced, then it is
    renamed, then both parent directories are fsynced. The claim counts the attempt in
    meta.json and makes that durable before any inference starts.

    Threads: claims and finishes come from the workers, the Finisher, the Models thread
    (failing an unloadable model's jobs) and the main thread (a start's last chances);
    recoveries from the main thread at start and the Watcher; the Watcher also looks at the
    running jobs (``cancel_requested``, ``flush_partial``). Each call on a job works on one
    that the calling thread holds alone (the Pool gave it out once; the claim rename, or a
    recovery under the WorkspaceLock, made it this daemon's). Shared between them: the
    running jobs' claims (``_claims``, under ``_claims_lock``), each claim's directory (the
    finishing thread and the Watcher's partial.txt flush, under the claim's ``lock``), and the
    memory of failed finishes (under _HandBacks' lock). ``daemon`` is written by the Watcher
    and read by the claims (one string, replaced whole).
    """

    def __init__(self, workspace: str, config: Config, model_name: str) -> None:
        self.workspace = workspace
        self.config = config
        self.model_name = model_name
        self.daemon = ""  # the name of the daemon that runs it (daemons/<name>.lock), recorded by each claim
        self.hooked = bool(config.on_done or config.on_batch_done)
        self._claims: dict[str, _Claim] = {}  # the running jobs' directories, by ID
        self._claims_lock = threading.Lock()
        self.hand_backs = _HandBacks(workspace, config)

    def _path(self, sub: str, name: str = "") -> str:
        return job_path(self.workspace, sub, name)

    def records_ends(self) -> bool:
        """Whether each end is recorded in hooks/done/ for its hook: this daemon has hooks, or
        hooks/ exists (another daemon of the workspace runs them, or one will)."""
        return self.hooked or os.path.isdir(os.path.join(self.workspace, HOOKS_OWED))

    # -- claim ---------------------------------------------------------------------------

    def claim(self, job_id: str, worker: str, stop: threading.Event, model: Optional[str] = None) -> Optional[RunningJob]:
        """Take ``job_id`` from ready/ into processing/, holding it (hold_job) from before the
        rename until it has moved on; None if someone else took it or it was malformed (then
        it is already in failed/). Raises _HandBack on an I/O error, _Busy while another
        claimer or a requeue holds it. ``model``: the model meta.json records."""
        self.hand_backs.check_room(job_id)
        taken = self._take(job_id)
        if taken is None:
            return None
        claim = self._count_attempt(job_id, *taken, worker, model or self.model_name)
        job = self.hold(RunningJob(job_id, "", {}, stop), claim)
        try:
            if _exists(claim.dir_fd, CANCEL_FILE):  # cancelled while we claimed it
                raise JobError("cancelled", "cancelled before it started (nrvna cancel)")
            self.hand_backs.check_write_failures(job_id, claim.before)
            job.prompt, job.params = self._read_input(claim.dir_fd)
            if job_param(job.params, "parent") is not None:
                job.params = self._continue(job, claim)
            try:  # tool turns answer the calls before them, its parent's too (unknown at its submit if not done)
                tool_answers(job_param(job.params, "messages") or [], ())
            except InvalidInput as err:
                raise JobError("bad_request", f"its conversation: {err}") from None
        except (JobError, OSError) as err:
            code = err.code if isinstance(err, JobError) else "bad_request"
            message = str(err) if isinstance(err, JobError) else f"cannot read job: {_os_error(err)}"
            if not self.finish(job, Outcome(error_code=code, error=message)):
                raise _HandBack(job_id) from None  # back in ready/ (a full disk): the caller retries it
            log.warning(f"Job failed: {job_id}: {message}")
            return None
        return job

    def _take(self, job_id: str) -> Optional[tuple[int, str]]:
        """Hold ``job_id`` and move it from ready/ to processing/: its directory's descriptor
        and its new path, or None (see claim)."""
        ready = self._path(READY, job_id)
        try:
            dir_fd = hold_job(ready)
        except OSError as err:
            if err.errno == errno.ENOENT:
                return None  # another claimer won, or the job was removed
            if err.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or a symlink, not a job directory
                with WorkspaceLock(self.workspace):
                    self.quarantine(job_id, READY)
                return None
            if err.errno == errno.EACCES:
                with WorkspaceLock(self.workspace):  # two daemons never fail it both
                    if not os.path.lexists(ready) or self.fail_inaccessible(job_id, READY):
                        return None
            raise
        if dir_fd is None:
            raise _Busy(job_id)
        path = self._path(PROCESSING, job_id)
        try:
            move(ready, path)
        except OSError as err:
            os.close(dir_fd)
            if isinstance(err, FileNotFoundError):
                return None  # another claimer won
            if isinstance(err, FileExistsError):
                log.error(f"cannot claim {job_id}: processing/{job_id} already exists; left in ready/")
                return None
            if isinstance(err, PermissionError) and self.fail_inaccessible(job_id, READY):
                return None  # a directory changes parent only if it is writable itself
            raise
        if not _same_entry(dir_fd, path):
            # ready/<id> was replaced between the open and the move: the directory moved is
            # nobody's, and the next recovery pass requeues it.
            os.close(dir_fd)
            return None
        return dir_fd, path

    def _count_attempt(self, job_id: str, dir_fd: int, path: str, worker: str, model: str) -> _Claim:
        """Count the attempt in the claimed job's meta.json, durably; on an I/O error hand the
        job back as it was and raise _HandBack."""
        import copy

        claim: Optional[_Claim] = None
        try:
            meta = read_meta(dir_fd)
            claim = _Claim(dir_fd, meta, path, copy.deepcopy(meta), _link_claimed_meta(dir_fd))
            attempts = meta.get("attempts") if isinstance(meta.get("attempts"), int) else 0
            if "submitted" not in meta:
                meta["submitted"] = submitted_time(job_id, dir_fd)
            meta.update(id=job_id, started=round(time.time(), 3), worker=worker, daemon=self.daemon,
                        model=model, attempts=attempts + 1)
            for key in ("finished", "code", "finish_reason"):
                meta.pop(key, None)
            record_event(meta, Status.Queued, "running")
            write_file(dir_fd, META_FILE, dump_meta(meta))
            os.fsync(dir_fd)
            fsync_dir(self._path(PROCESSING))
            fsync_dir(self._path(READY))
        except OSError as err:
            log.limited(f"claim:{err.errno}", f"cannot claim {job_id}: {_os_error(err)}; handing it back "
                        "(no attempt counted)")
            if claim is not None:
                self.hand_backs.restore_meta(job_id, claim)
            self.hand_backs.hand_back(job_id)
            os.close(dir_fd)
            raise _HandBack(job_id) from None
        return claim

    def _continue(self, job: RunningJob, claim: _Claim) -> dict[str, Any]:
        """A child's parameters with its whole conversation as its messages (its parent's,
        then its own turns: see parent_conversation). A parent that is queued or running again
        hands the job back unchanged (_ParentWaits)."""
        parent = job_param(job.params, "parent")
        turns = parent_conversation(self.workspace, parent, self.config.max_prompt_bytes * 8 + (1 << 20))
        if turns is None:
            self._release(job)
            self.hand_backs.restore_meta(job.id, claim)
            self.hand_backs.hand_back(job.id)
            os.close(claim.dir_fd)
            raise _ParentWaits(job.id, parent)
        own = conversation_turns(job.prompt, job.params, "")[:-1]  # its own turns (no answer yet)
        params = {k: v for k, v in job.params.items() if k != "system"}
        params["messages"] = continued_turns(turns, own)
        return params

    def _read_input(self, dir_fd: int) -> tuple[str, dict[str, Any]]:
        import json

        try:
            data = read_file(dir_fd, PROMPT_FILE, self.config.max_prompt_bytes)
        except FileNotFoundError:
            raise JobError("bad_request", "job has no prompt.txt") from None
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise JobError("bad_request", f"prompt.txt is not valid UTF-8 (byte {err.start})") from None
        if not prompt.strip():
            raise JobError("bad_request", "prompt.txt is empty")
        if "\x00" in prompt:
            raise JobError("bad_request", "prompt.txt contains a NUL byte")
        try:
            raw = read_file(dir_fd, PARAMS_FILE, params_limit(self.config.max_prompt_bytes))
        except FileNotFoundError:
            return prompt, {}
        try:
            params = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as err:
            raise JobError("bad_request", f"params.json is not valid JSON: {err!r}") from None
        try:  # with this daemon's own default of max_tokens, which may not be the submitter's
            return prompt, validate_params(params, self.config.max_tokens)
        except InvalidInput as err:
            raise JobError("bad_request", f"params.json: {err}") from None
        except Exception as err:  # a check's own bug must fail this job alone, never its batch-mates
            raise JobError("bad_request", f"params.json could not be checked: {err!r}") from None

    def hold(self, job: RunningJob, claim: _Claim) -> RunningJob:
        with self._claims_lock:
            self._claims[job.id] = claim
        return job

    def _release(self, job: RunningJob) -> _Claim:
        """``job``'s claim, closed to the partial.txt flusher (its directory is the caller's to
        close)."""
        with self._claims_lock:
            claim = self._claims.pop(job.id)
        with claim.lock:  # the partial.txt flusher must not touch dir_fd once it is closed
            claim.closed = True
        return claim

    def _claim_of(self, job: RunningJob) -> Optional[_Claim]:
        with self._claims_lock:
            return self._claims.get(job.id)

    def cancel_requested(self, job: RunningJob) -> bool:
        """Whether ``nrvna cancel`` has asked to stop the running ``job``."""
        claim = self._claim_of(job)
        return claim is not None and os.path.lexists(os.path.join(claim.path, CANCEL_FILE))

    def flush_partial(self, job: RunningJob) -> None:
        """Append the text ``job`` emitted since the last flush to its partial.txt (no fsync:
        partial.txt is for watching, result.txt is the record)."""
        if not job.emitted:
            return
        claim = self._claim_of(job)
        if claim is None:
            return
        with claim.lock:
            if claim.closed:
                return
            chunks = []
            while job.emitted:
                chunks.append(job.emitted.popleft())
            data = "".join(chunks).encode("utf-8")
            try:
                fd = os.open(PARTIAL_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND | O_NOFOLLOW | O_CLOEXEC,
                             FILE_MODE, dir_fd=claim.dir_fd)
                try:
                    write_all(fd, data)
                finally:
                    os.close(fd)
            except OSError as err:  # a full disk: this text is missing from partial.txt, not from the job
                log.limited(f"partial:{err.errno}", f"cannot append to {job.id}'s partial.txt: {_os_error(err)}")

    # -- finish --------------------------------------------------------------------------

    def finish(self, job: RunningJob, outcome: Outcome) -> bool:
        """Record the outcome and move the job to output/ or failed/. Returns False when an
        I/O error forced it back to ready/ (see _HandBacks.cannot_finish; the caller retries it
        later)."""
        claim = self._release(job)
        try:
            meta = dict(claim.meta)  # the claim's stays as it was, for a hand-back's events
            files, dest = self._record(meta, outcome)
            turns = conversation_turns(job.prompt, job.params, outcome.text, outcome.message) if dest == OUTPUT else None
            if turns is not None:  # what a child of this job continues (parent)
                import json

                files.append((CONVERSATION_FILE, json.dumps(turns, ensure_ascii=False).encode("utf-8")))
            try:
                self._publish(job.id, claim, meta, files, dest)
            except OSError as err:
                # What the finish writes, each file rounded up to a block, meta.json included.
                needed = sum(len(data) for _, data in files) + ROOM_SLACK * (len(files) + 2)
                return self.hand_backs.cannot_finish(job.id, claim, err, needed)
            self.hand_backs.finished(job.id, claim.before)
            return True
        finally:
            os.close(claim.dir_fd)

    def _record(self, meta: dict[str, Any], outcome: Outcome) -> tuple[list[tuple[str, bytes]], str]:
        """Put ``outcome`` into ``meta``; return the files to write and the state it goes to."""
        meta.update(finished=round(time.time(), 3), prompt_tokens=outcome.prompt_tokens,
                    generated_tokens=outcome.generated_tokens)
        if outcome.prompt_computed is not None:
            meta["prompt_computed"] = outcome.prompt_computed
        if outcome.prompt_reused is not None:
            meta["prompt_reused"] = outcome.prompt_reused
        if outcome.error_code is None:
            meta["finish_reason"] = outcome.finish_reason
            files = [(RESULT_FILE, outcome.text.encode("utf-8"))]
            if outcome.message is not None:  # result.txt: a JSON line per call, as `get` prints them
                import json

                files = [(RESULT_FILE, call_lines(outcome.message["tool_calls"]).encode("utf-8")),
                         (TOOL_CALLS_FILE, json.dumps(outcome.message, ensure_ascii=False).encode("utf-8"))]
            dest = OUTPUT
            record_event(meta, Status.Running, "done")
        else:
            meta["code"] = outcome.error_code
            record_event(meta, Status.Running, "cancelled" if outcome.error_code == "cancelled" else "failed",
                         outcome.error_code)
            files = [(ERROR_FILE, (outcome.error or outcome.error_code).rstrip("\n").encode("utf-8") + b"\n")]
            if outcome.text:
                files.append((PARTIAL_FILE, outcome.text.encode("utf-8")))
            dest = FAILED
        if outcome.logprobs is not None:
            import json

            files.append((LOGPROBS_FILE, json.dumps(outcome.logprobs, ensure_ascii=False).encode("utf-8")))
        if outcome.choices is not None and dest == OUTPUT:
            import json

            files.append((CHOICES_FILE, json.dumps(outcome.choices, ensure_ascii=False).encode("utf-8")))
        if outcome.reasoning is not None:  # a thinking model's job: its thinking apart, counted
            meta["reasoning_tokens"] = outcome.reasoning_tokens
            if outcome.thinking_closed is not None:  # the daemon closed it: why (budget, share, eog, model)
                meta["thinking_closed"] = outcome.thinking_closed
            if outcome.reasoning:
                files.append((REASONING_FILE, outcome.reasoning.encode("utf-8")))
        return files, dest

    def _publish(self, job_id: str, claim: _Claim, meta: dict[str, Any], files: list[tuple[str, bytes]],
                 dest: str) -> None:
        """Write ``files`` and ``meta`` into the claimed job's directory and move it to ``dest``."""
        dir_fd = claim.dir_fd
        if dest == OUTPUT:  # result.txt holds it all; a late cancel did not take effect
            # Unconditional: whether the Watcher wrote partial.txt depends on timing,
            # and a finish must make the same calls every time (crash-point tests).
            _unlink_quietly(PARTIAL_FILE, dir_fd)
            claim.cancel_dropped = _unlinked(CANCEL_FILE, dir_fd)
        for name, data in files:
            write_file(dir_fd, name, data)
        write_file(dir_fd, META_FILE, dump_meta(meta))
        # Unconditional too; gone before the fsync, so no finished job keeps it. A failure
        # after this point restores meta.json by writing it (see _HandBacks.restore_meta).
        _unlink_quietly(CLAIMED_META, dir_fd)
        claim.kept = ""
        os.fsync(dir_fd)
        if self.records_ends():
            owe_hooks(self.workspace, job_id)
        try:
            move_job(self.workspace, job_id, PROCESSING, dest)
        except FileExistsError:
            self._name_taken(job_id, dir_fd, dest)

    def _name_taken(self, job_id: str, dir_fd: int, dest: str) -> None:
        """``dest/<id>`` already exists: never replace it, never lose this job either."""
        if dest == FAILED:
            log.error(f"failed/{job_id} already exists; job left in processing/")
            return
        write_file(dir_fd, ERROR_FILE,
                   f"output/{job_id} already exists, so this job's result could not be published "
                   f"there; result.txt is kept here\n".encode())
        os.fsync(dir_fd)
        move_job(self.workspace, job_id, PROCESSING, FAILED)

    def requeue(self, job: RunningJob) -> None:
        """Return an interrupted job to ready/ (shutdown), not counting the attempt."""
        claim = self._release(job)
        dir_fd = claim.dir_fd
        try:
            meta = dict(claim.meta)
            meta["attempts"] = max(0, int(meta.get("attempts", 1)) - 1)
            for key in ("started", "worker"):
                meta.pop(key, None)
            record_event(meta, Status.Running, "requeued", "stopped")
            _clear_outputs(dir_fd)
            write_file(dir_fd, META_FILE, dump_meta(meta))
            os.fsync(dir_fd)
            move_job(self.workspace, job.id, PROCESSING, READY)
            log.info(f"Returned job to the queue: {job.id}")
        except OSError as err:
            log.error(f"cannot requeue {job.id}: {_os_error(err)}; recovered at next start")
        finally:
            os.close(dir_fd)

    def fail_inaccessible(self, job_id: str, sub: str) -> bool:
        """A job directory the daemon may not open or move because its own mode lacks the
        owner's rwx (``chmod 000``, say): fail it unread, rather than retry its claim forever,
        and return True. It is made 0700 again, as every job directory, only so that it can
        take error.txt and move to failed/. False when the directory's mode is not the cause
        (a state directory not writable, say): that is the workspace's fault, not the job's,
        and the claim is retried as after any I/O error."""
        path = self._path(sub, job_id)
        try:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
        except OSError:
            return False
        if mode & 0o700 == 0o700:
            return False
        try:
            os.chmod(path, DIR_MODE)
            mark_failed(self.workspace, sub, job_id, "bad_request", f"the job directory was not accessible to "
                        f"the daemon (mode {mode:o}); it was failed without being read")
            if self.records_ends():
                owe_hooks(self.workspace, job_id)
            move_job(self.workspace, job_id, sub, FAILED)
        except OSError as err:
            log.error(f"{sub}/{job_id} is not accessible to the daemon and cannot be made so "
                      f"({_os_error(err)}); left there until the next start")
            return True
        log.warning(f"Job failed: {job_id}: its directory was not accessible (mode {mode:o})")
        return True

    def quarantine(self, job_id: str, sub: str) -> None:
        """A non-directory in ``sub`` (ready/ or processing/): wrap it, unopened, in a real
        failed/<id>/ dir. The caller holds the WorkspaceLock (recovery publishes a wrap that
        a dead daemon left)."""
        try:
            mode = os.lstat(self._path(sub, job_id)).st_mode
        except FileNotFoundError:
            return  # taken by a quarantine that held the lock before us
        kind = ("a symbolic link" if stat.S_ISLNK(mode) else
                "a regular file" if stat.S_ISREG(mode) else "not a directory")
        wrap = self._path(PROCESSING, f".{job_id}.quarantine")
        _remove_tree(wrap)
        os.mkdir(wrap, DIR_MODE)
        fd = open_dir(wrap)
        try:
            write_file(fd, ERROR_FILE, (f"input/ready/{job_id} is {kind}, not a job directory; it was "
                                        f"moved here as '{QUARANTINED_ENTRY}' without being opened\n").encode())
            write_file(fd, META_FILE, dump_meta({"id": job_id, "code": "bad_request", "attempts": 0,
                                             "finished": round(time.time(), 3)}))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(self._path(sub, job_id), os.path.join(wrap, QUARANTINED_ENTRY))
        fsync_dir(wrap)
        fsync_dir(self._path(sub))
        self.publish_quarantine(job_id, wrap)

    def publish_quarantine(self, job_id: str, wrap: str) -> None:
        if self.records_ends():
            owe_hooks(self.workspace, job_id)
        try:
            move(wrap, self._path(FAILED, job_id))
        except FileExistsError:
            log.error(f"failed/{job_id} already exists; quarantined entry left in {wrap}")
            return
        fsync_dir(self._path(FAILED))
        fsync_dir(self._path(PROCESSING))
        log.warning(f"Job failed: {job_id}: input/ready/{job_id} was not a job directory")

# ============================================================================
# 12.3 Recovery and hooks
# ============================================================================
# _Recovery requeues orphans at start and when a daemon dies; Hooks runs the on-done commands
# from hooks/done/, at least once each. Invariant: an orphan is requeued only when no live daemon
# holds it.


class _Recovery:
    """Returns the jobs of daemons that died to the queue: orphans in processing/ (or fails
    them at the attempt ceiling), then, at a start, runs alone the ones whose next death
    would fail them; removes the staging leftovers of clients that died.

    Threads: the main thread at start (``run_last_chances`` too, before the workers start),
    then the Watcher (a daemon died, and every ORPHAN_SECONDS). Each pass is under the
    WorkspaceLock, and leaves alone a job a live daemon holds (this one's workers' included:
    see hold_orphan), so it touches no job another thread works on.
    """

    def __init__(self, processor: Processor) -> None:
        self.processor, self.workspace, self.config = processor, processor.workspace, processor.config

    def _path(self, sub: str, name: str = "") -> str:
        return job_path(self.workspace, sub, name)

    def recover(self) -> list[tuple[str, int]]:
        """Return orphans in processing/ (their daemon died) to ready/, or fail them at the
        attempt ceiling; return the recovered (id, attempts). A job a live daemon holds is
        left alone. At a daemon's start, whenever a live daemon sees another one die, and
        every ORPHAN_SECONDS; under the WorkspaceLock, so two recoveries never take the same job."""
        recovered = []
        with WorkspaceLock(self.workspace):
            with os.scandir(self._path(PROCESSING)) as entries:
                names = sorted(e.name for e in entries)
            for name in names:
                path = self._path(PROCESSING, name)
                if name.startswith("."):
                    self._recover_hidden(name, path)  # a dead daemon's (quarantines hold the lock)
                    continue
                dir_fd = hold_orphan(self.workspace, name)
                if dir_fd is None:
                    try:
                        mode = os.lstat(path).st_mode
                    except FileNotFoundError:
                        continue  # moved on meanwhile
                    if not stat.S_ISDIR(mode):
                        self.processor.quarantine(name, PROCESSING)
                    elif stat.S_IMODE(mode) & 0o700 != 0o700:
                        self.processor.fail_inaccessible(name, PROCESSING)
                    continue  # otherwise held by a live daemon
                attempts = self._recover_one(name, dir_fd, path)
                if attempts is not None:
                    recovered.append((name, attempts))
        return recovered

    def _recover_one(self, name: str, dir_fd: int, path: str) -> Optional[int]:
        """Requeue the orphan ``name`` (held as ``dir_fd``, closed here); its attempts, or
        None when it was failed at the attempt ceiling."""
        meta = read_meta(dir_fd)
        attempts = meta.get("attempts") if isinstance(meta.get("attempts"), int) else 0
        if attempts >= self.config.max_attempts:
            # The killed attempt's temporaries and results go; its partial text stays
            # (what it generated before the deaths is the evidence).
            _clear_outputs(dir_fd, keep=(PARTIAL_FILE,))
            job = self.processor.hold(RunningJob(name, "", {}, threading.Event()), _Claim(dir_fd, meta, path, dict(meta)))
            self.processor.finish(job, Outcome(error_code="crash_ceiling", error=(
                f"the daemon stopped {attempts} times while running this job "
                f"(NRVNA_MAX_ATTEMPTS={self.config.max_attempts}); it is not retried again")))
            log.warning(f"Failed orphaned job after {attempts} attempts: {name}")
            return None
        try:
            _clear_outputs(dir_fd)
            record_event(meta, Status.Running, "requeued", "crashed")
            try:
                write_file(dir_fd, META_FILE, dump_meta(meta))
                os.fsync(dir_fd)
            except OSError as err:  # a full disk: only the event is lost (events read the move anyway);
                # the attempt was counted durably by the claim. A start must not fail over it.
                log.limited(f"recover:{err.errno}", f"cannot record {name}'s requeue in its meta.json "
                            f"({_os_error(err)}); requeuing it all the same")
            move_job(self.workspace, name, PROCESSING, READY)
        finally:
            os.close(dir_fd)
        log.warning(f"Recovered orphaned job: {name} (attempt {attempts} of {self.config.max_attempts})")
        return attempts

    def _recover_hidden(self, name: str, path: str) -> None:
        if name.endswith(".quarantine") and os.path.lexists(os.path.join(path, QUARANTINED_ENTRY)):
            self.processor.publish_quarantine(name[1:-len(".quarantine")], path)
        else:
            _remove_tree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
            fsync_dir(self._path(PROCESSING))

    def clean_staging(self, now: Optional[float] = None) -> int:
        """Remove input/writing/ leftovers of clients that died before publishing."""
        now = time.time() if now is None else now
        removed = 0
        stale = []
        with os.scandir(self._path(WRITING)) as entries:
            for entry in entries:
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_STAGING_SECONDS:
                        stale.append(entry.name)
                except FileNotFoundError:
                    continue  # published (or given up) by its client while we looked
        for name in stale:
            path = self._path(WRITING, name)
            if os.path.isdir(path) and not os.path.islink(path):
                _remove_tree(path)
            else:
                _unlink_quietly(path, None)
            removed += 1
            log.warning(f"Removed abandoned staging entry input/writing/{name} (its client died before publishing)")
        if removed:
            fsync_dir(self._path(WRITING))
        return removed

    def run_last_chances(self, recovered: list[tuple[str, int]], session: Session, stop: threading.Event,
                         here: Callable[[str], bool]) -> None:
        """Run alone, one by one, the orphans whose next daemon death would fail them.

        A daemon death counts an attempt against every job in flight, and submission order
        brings the same jobs back together: without this, a poison job would take its
        innocent batch-mates to the attempt ceiling with it. Alone, it only fails itself.
        ``here``: whether a job runs on the model ``session`` runs.
        """
        ceiling = self.config.max_attempts
        last = sorted((job_id for job_id, attempts in recovered if 1 <= attempts and attempts >= ceiling - 1
                       and here(job_id)), key=order_key)
        for job_id in last:
            if stop.is_set():
                return
            log.warning(f"Running job alone (the daemon died while it ran): {job_id}")
            try:
                job = self.processor.claim(job_id, "Main", stop)
            except (_HandBack, _Busy, _ParentWaits):  # left in ready/ for the workers
                continue
            if job is None:
                continue
            try:
                session.start(job)
                while session.active():
                    if stop.is_set():
                        session.drop(job)
                        self.processor.requeue(job)
                        return
                    for done, outcome in session.step():
                        self.processor.finish(done, outcome)
            except JobError as err:
                self.processor.finish(job, Outcome(error_code=err.code, error=str(err)))
            except Exception as err:
                session.drop(job)
                self.processor.finish(job, Outcome(error_code="runner_error", error=f"runner failed: {err!r}"))


def _env_text(value: Any) -> str:
    """A job's field as an environment variable's value: "" unless it is a string the
    environment can hold (no NUL, no lone surrogate)."""
    if not isinstance(value, str) or "\x00" in value:
        return ""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return ""
    return value


class Hooks:
    """Runs the user's commands when jobs end (``--on-done``) and when every job of a tag has
    ended (``--on-batch-done``): off the decode threads, at most NRVNA_HOOK_JOBS at a time,
    each killed after NRVNA_HOOK_TIMEOUT seconds.

    At least once: every end is first recorded in hooks/done/<id> (owe_hooks, before the
    job's move), and the record goes only once the job's hooks have run, so a daemon that
    dies between a job's end and its hook runs the hook after the restart. A hook still
    running when the daemon stops is stopped, and runs again at the next start. A hook that
    fails or times out is logged and not run again: it never changes the job.

    A tag's batch hook: each end of a tagged job updates the tag's unfinished set (read in
    full from the tag index and the state directories the first time, and again when it
    empties, so jobs added to the tag meanwhile count); when none is left, hooks/batch/<tag>
    records {"jobs": N, "done", "failed", "ran": false}, durably, then the hook runs, then
    "ran": true. It runs
    once per N: a retry of one of its jobs does not run it again, more jobs added to the tag
    and ended do.

    Threads: the ``Hooks`` thread lists hooks/done/ and hands tasks to NRVNA_HOOK_JOBS
    ``Hook-N`` threads (through a queue.Queue); the workers and the Finisher call ``poke``
    (an Event); the main thread ``prepare``, ``start``, ``idle`` and ``stop`` (which joins
    them before it closes ``_held``, the Hooks thread's). What they share (``_in_flight``,
    ``_procs``, ``_unfinished``, ``_errors``) is under ``_lock``.
    """

    def __init__(self, workspace: str, config: Config, stop: threading.Event) -> None:
        import queue

        self.workspace = os.path.abspath(workspace)
        self.on_done, self.on_batch_done = config.on_done, config.on_batch_done
        self.timeout, self.jobs = config.hook_timeout, config.hook_jobs
        self.owed = os.path.join(workspace, HOOKS_OWED)
        self.batches = os.path.join(workspace, HOOKS_BATCH)
        self._stop = stop
        self._wake = threading.Event()
        self._tasks: Any = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()  # job IDs and "tag:" + tag queued or running
        self._procs: set[Any] = set()
        self._unfinished: dict[str, set[str]] = {}  # tag -> its jobs not ended yet (as last seen)
        self._errors: dict[str, tuple[int, float]] = {}  # job ID -> (errors in a row, when to try again)
        self._threads: list[threading.Thread] = []
        self._held: Optional[int] = None  # hooks/' lock: this daemon's turn to run hooks (see _take_turn)

    def prepare(self) -> None:
        """Make hooks/ (before recovery: a job it fails owes its hooks too)."""
        for folder in (os.path.dirname(self.owed), self.owed, self.batches):
            try:
                os.mkdir(folder, DIR_MODE)
            except FileExistsError:
                pass
        fsync_dir(self.workspace)
        fsync_dir(os.path.dirname(self.owed))

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._coordinate, name="Hooks", daemon=True)]
        self._threads += [threading.Thread(target=self._run_tasks, name=f"Hook-{i}", daemon=True)
                          for i in range(self.jobs)]
        for thread in self._threads:
            thread.start()

    def poke(self) -> None:
        """A job ended: look at hooks/done/ now, not at the next round."""
        self._wake.set()

    def idle(self) -> bool:
        """No hook owed or running (``--drain`` waits for this)."""
        with self._lock:
            if self._in_flight:
                return False
        return not _folder_entries(self.workspace, HOOKS_OWED)

    def stop(self) -> None:
        """Stop the running hooks (their records stay: they run again at the next start)."""
        import signal

        self._wake.set()
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                pass
        for thread in self._threads:
            thread.join()
        if self._held is not None:
            os.close(self._held)
            self._held = None

    def _submit(self, task: str) -> None:
        with self._lock:
            if task in self._in_flight:
                return
            self._in_flight.add(task)
        self._tasks.put(task)

    def _take_turn(self) -> bool:
        """Whether this daemon runs the workspace's hooks: the one holding hooks/' lock does,
        so each job's hook runs once whichever daemon ran the job; when it stops or dies,
        another daemon with hooks takes over (and runs what it left owed)."""
        if self._held is not None:
            return True
        self._held = _locked(open_dir(os.path.dirname(self.owed)))
        if self._held is None:
            return False
        for tag in sorted(os.listdir(self.batches)):  # a batch hook owed by a daemon that stopped
            if ID_PATTERN.fullmatch(tag) and self._batch_record(tag).get("ran") is False:
                self._submit("tag:" + tag)
        return True

    def _coordinate(self) -> None:
        _name_os_thread("Hooks")
        while not self._stop.is_set():
            try:
                if not self._take_turn():
                    self._stop.wait(0.5)
                    continue
                now = time.monotonic()
                with self._lock:
                    errors = dict(self._errors)
                for name in sorted(os.listdir(self.owed), key=order_key):
                    if is_valid_id(name) and errors.get(name, (0, now))[1] <= now:
                        self._submit(name)
            except OSError as err:
                log.error(f"cannot list {self.owed}: {_os_error(err)}")
            self._wake.wait(0.5)
            self._wake.clear()

    def _run_tasks(self) -> None:
        import queue

        while not self._stop.is_set():
            try:
                task = self._tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if task.startswith("tag:"):
                    self._run_batch(task[4:])
                else:
                    self._job_ended(task)
                    with self._lock:
                        self._errors.pop(task, None)
            except Exception as err:  # a hook's bookkeeping must never take the daemon down
                if task.startswith("tag:"):  # its record stays "ran": false
                    log.error(f"hook error for {task}: {err!r}; tried again at the next start")
                else:  # its record stays: tried again, less and less often (never every round)
                    with self._lock:
                        errors = self._errors.get(task, (0, 0.0))[0] + 1
                        delay = min(HOOK_RETRY_SECONDS * 2 ** errors, HOOK_RETRY_MAX)
                        self._errors[task] = (errors, time.monotonic() + delay)
                    log.error(f"hook error for {task}: {err!r}; tried again in {delay:g} s")
            finally:
                with self._lock:
                    self._in_flight.discard(task)

    def _job_ended(self, job_id: str) -> None:
        if not os.path.lexists(os.path.join(self.owed, job_id)):
            return  # its hook ran: a listing taken before the record went queued it again
        status, path = locate_job(self.workspace, job_id)
        if status is Status.Missing:  # removed (clean) before its hooks ran
            _unlink_quietly(os.path.join(self.owed, job_id), None)
            return
        if not status.finished:  # ended, then retried, or died before its move: it ends again
            return
        try:
            fd = open_dir(path)
        except FileNotFoundError:  # moved on (retried) or removed since: the next round looks again
            return
        except OSError:  # unreadable: its hook runs all the same, without the job's fields
            meta, params = {}, {}
        else:
            try:
                meta, params = read_meta_and_params(fd)
            finally:
                os.close(fd)
        # A hand-made job's params.json was never validated (its claim failed it): a tag that is
        # not a valid name names no batch, and no field may break the environment (either
        # raised here before, and the record stayed: the hook ran again every 0.5 s, forever).
        tag = job_param(params, "tag")
        tag = tag if isinstance(tag, str) and ID_PATTERN.fullmatch(tag) else None
        if self.on_done:
            env = hook_environment("on_done", {
                "NRVNA_WORKSPACE": self.workspace, "NRVNA_JOB_ID": job_id, "NRVNA_STATUS": status.value,
                "NRVNA_CODE": _env_text(meta.get("code")) if status is Status.Failed else "",
                "NRVNA_CUSTOM_ID": _env_text(job_param(params, "custom_id")), "NRVNA_TAG": tag or ""})
            if not self._run(f"on-done hook for {job_id}", self.on_done, env, path):
                return  # stopped by the daemon's stop: runs again at the next start
        if self.on_batch_done and tag:
            try:
                self._tag_progress(tag, job_id)
            except WorkspaceError as err:  # a planted or damaged index: its tag's hook alone is lost,
                # and the job's own hook is not run again and again for it
                log.limited(f"tag-index:{tag}", f"batch hook of tag {tag} not run: {err}")
        _unlink_quietly(os.path.join(self.owed, job_id), None)

    def _tag_progress(self, tag: str, job_id: str) -> None:
        """Count ``job_id``'s end against its tag; at the tag's last, owe and run its batch hook."""
        with self._lock:
            left = self._unfinished.get(tag)
            if left is not None:
                left.discard(job_id)
                if left:
                    return
            ids = [member for member, _ in tag_members(self.workspace, tag)]
            states = bulk_states(self.workspace, ids)
            unfinished = set(ids).intersection(_folder_entries(self.workspace, WRITING))  # staged: not published yet
            unfinished.update(member for member, state in states.items() if state in (Status.Queued, Status.Running))
            if unfinished:
                self._unfinished[tag] = unfinished
                return
            self._unfinished.pop(tag, None)
            record = self._batch_record(tag)
            if record.get("jobs") == len(ids):
                if record.get("ran") is not False:
                    return  # ran for these jobs already (a retried job ended again)
            else:
                done = sum(state is Status.Done for state in states.values())
                failed = sum(state is Status.Failed for state in states.values())
                self._write_batch_record(tag, {"jobs": len(ids), "done": done, "failed": failed, "ran": False},
                                         sync=True)
        self._submit("tag:" + tag)

    def _run_batch(self, tag: str) -> None:
        record = self._batch_record(tag)
        if record.get("ran") is not False:
            return
        env = hook_environment("on_batch_done", {
            "NRVNA_WORKSPACE": self.workspace, "NRVNA_TAG": tag, "NRVNA_JOBS": str(record.get("jobs")),
            "NRVNA_DONE": str(record.get("done")), "NRVNA_FAILED": str(record.get("failed"))})
        if self._run(f"on-batch-done hook for tag {tag}", self.on_batch_done, env, tag):
            self._write_batch_record(tag, dict(record, ran=True), sync=False)

    def _batch_record(self, tag: str) -> dict[str, Any]:
        return read_record(os.path.join(self.batches, tag))

    def _write_batch_record(self, tag: str, record: dict[str, Any], sync: bool) -> None:
        import json

        fd = open_dir(self.batches)
        try:
            write_file(fd, tag, json.dumps(record).encode(), sync=sync)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _run(self, what: str, command: str, env: dict[str, str], argument: str) -> bool:
        """Run ``command`` with ``argument`` as $1 through /bin/sh; False if the daemon's stop
        stopped it (it is owed still), True once it has exited or was killed for its timeout."""
        import signal
        import subprocess

        if self._stop.is_set():
            return False
        began = time.monotonic()
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", command + ' "$@"', "nrvna-hook", argument],
                                    env={**os.environ, **env}, stdin=subprocess.DEVNULL, start_new_session=True)
        except (OSError, ValueError) as err:  # ValueError: a value the environment cannot hold
            log.error(f"{what} could not start: {_os_error(err) if isinstance(err, OSError) else err}")
            return True
        with self._lock:
            self._procs.add(proc)
        if self._stop.is_set():  # stop() may have looked at _procs before this one was in it
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                pass
        try:
            code = proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            log.warning(f"{what} ran longer than NRVNA_HOOK_TIMEOUT={self.timeout:g} s: killed (not run again)")
            return True
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self._stop.is_set() and code < 0:
            return False
        if code != 0:
            log.warning(f"{what} failed ({'exit status %d' % code if code > 0 else 'signal %d' % -code}); "
                        "not run again (the job is unchanged)")
        else:
            log.debug(f"{what} ran in {time.monotonic() - began:.2f} s")
        return True


# ============================================================================
# 12.4 Models
# ============================================================================
# _Models routes jobs to the models this daemon serves and loads them (a failed load is tried
# again later, then its jobs fail load_failed); _ModelSwitch parks every worker while the active
# model changes.


LOAD_RETRY_SECONDS = 5.0  # a model that failed to load is tried again after this, then twice as long each time
LOAD_RETRY_MAX_SECONDS = 300.0


class _ServedModel:
    """One model a daemon serves: its file, its kind ("chat" or "embed", read from the GGUF
    before loading) and, while loaded, its runner and one session per worker.

    Threads: _Models' (the Models thread loads and unloads it; see there)."""

    __slots__ = ("name", "path", "kind", "runner", "sessions", "used")

    def __init__(self, name: str, path: Optional[str], kind: str, runner: Optional[Runner] = None) -> None:
        self.name, self.path, self.kind, self.runner = name, path, kind, runner
        self.sessions: list[Session] = []
        self.used = 0.0  # when it last became the active model (eviction: least recently used)


def _resident_mib() -> float:
    """This process's resident memory now (MiB), 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as handle:
            return next((int(line.split()[1]) / 1024 for line in handle if line.startswith("VmRSS:")), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def _as_given(config: Config, name: str, value: Any) -> str:
    """Setting ``name`` at ``value``, written as the user set it: its flag where a flag set it (a
    variable would lose to the flag), else its variable."""
    flags = SETTINGS[name].flags
    if flags and config.given.get(name, "").startswith("-"):
        return f"{flags[-1]} {value}"
    return f"{SETTINGS[name].env}={value}"


def check_memory_budget(config: Config, name: str, report: Mapping[str, Any], workers: int, fixed_mib: float,
                        saves: bool) -> None:
    """ConfigError (exit 2 at start) when NRVNA_MAX_MEMORY cannot hold model ``name`` with
    ``workers`` contexts as ``report`` (model_memory, once one context is made) states them, beside
    ``fixed_mib`` (the process before any model, other models loaded) and, where contexts are
    saved, NRVNA_CACHE_PENDING; it says what would fit instead."""
    budget = size_bytes(config.max_memory) / _MIB
    if not budget:
        return
    if not saves:
        pending = 0.0
    elif config.cache_pending == "auto":
        pending = SAVES_PENDING * report["cells_per_job"] * report["kv_bytes_per_token"] / _MIB
    else:
        pending = size_bytes(config.cache_pending) / _MIB
    kv, compute, output = report["kv_mib"], report["compute_mib"], report["output_mib"]
    room = budget - fixed_mib - pending - report["weights_mib"]  # for the contexts
    need = budget - room + workers * (kv + compute + output)
    if need <= budget:
        return
    fits = []
    if 1 <= room // (kv + compute + output) < workers:
        fits.append(_as_given(config, "workers", int(room // (kv + compute + output))))
    per_cell = kv / max(1, report["cells"])  # a context's cells are NRVNA_MAX_CTX and one job's share more
    max_ctx = int((room / workers - compute - output) / per_cell * config.max_ctx / max(1, report["cells"])) // 256 * 256
    if 256 <= max_ctx < config.max_ctx:
        fits.append(_as_given(config, "max_ctx", max_ctx))
    bytes_now = KV_TYPES[config.kv_type][1]
    smaller = [t for t, (_, size) in KV_TYPES.items() if size < bytes_now
               and workers * (kv * size / bytes_now + compute + output) <= room]
    if smaller:
        fits.append(_as_given(config, "kv_type", smaller[0]))
    if pending and need - pending <= budget:
        fits.append(_as_given(config, "cache_pending", f"{max(1, int(budget - need + pending))}M"))
    raise ConfigError(
        f"{config.named('max_memory')} ({budget:,.0f} MiB) cannot hold this daemon: it needs {need:,.0f} MiB (this process and other "
        f"models {fixed_mib:,.0f}, {name}'s weights {report['weights_mib']:,.0f}, {workers} contexts x "
        f"{kv + compute + output:,.1f} (KV cache {kv:,.1f}, compute {compute:,.1f}, output {output:,.1f})"
        + (f", contexts waiting to be saved {pending:,.0f}" if pending else "") + "); "
        + (f"it would fit with {' or '.join(fits)}" if fits else "nothing here fits it: a larger budget or a smaller model"))


def _file_signature(path: Optional[str]) -> Optional[tuple[int, int, int]]:
    """What tells a replaced or rewritten model file from the one that failed to load."""
    try:
        info = os.stat(path) if path is not None else None
    except OSError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns) if info is not None else None


class _LoadFailure:
    """A model of a daemon that could not be loaded at its turn: its jobs wait (set aside)
    until ``retry_at``, then are routed to it again (``due``) for one more try; after
    NRVNA_MAX_LOAD_FAILURES failures (``gave_up``) they fail with load_failed, until the
    file changes (``signature``). ``wall`` is retry_at on the clock the records show.

    Threads: read and written under _Models' lock (the Models thread changes it)."""

    __slots__ = ("count", "error", "retry_at", "wall", "due", "gave_up", "signature")

    def __init__(self, path: Optional[str]) -> None:
        self.count, self.error, self.due, self.gave_up = 0, "", False, False
        self.retry_at, self.wall = 0.0, 0.0
        self.signature = _file_signature(path)

    def failed(self, error: str, limit: int) -> None:
        self.count += 1
        self.error, self.due, self.gave_up = error, False, self.count >= limit
        delay = min(LOAD_RETRY_SECONDS * 2 ** (self.count - 1), LOAD_RETRY_MAX_SECONDS)
        self.retry_at, self.wall = time.monotonic() + delay, time.time() + delay


def _models_folder(name: str) -> bool:
    """Whether a MODEL argument names a directory of models (model.gguf/ is check_gguf's to refuse)."""
    return os.path.isdir(name) and not name.lower().endswith(".gguf")


class _ModelSwitch:
    """The Models thread of a daemon serving several models: when _Models.choose says, it
    stops the workers taking jobs, waits until every worker has parked (its running jobs
    ended), makes the next model the active one, and lets the workers go on with its jobs.

    Threads: its own (Models) runs ``run`` and the switches; the workers ``park`` and
    ``leave``; the Scanner and the workers set ``wake`` (an Event); the main thread calls
    ``release`` and reads ``failure`` once the daemon has stopped. ``_parked``,
    ``_generation`` and ``workers`` change under ``_cond`` (``workers`` is read without it:
    one int, and a worker leaving mid-switch is waited for under it).
    """

    def __init__(self, models: _Models, pool: Pool, stop: threading.Event, workers: int,
                 use: Callable[[list[Session]], None], loads: _WorkerLoads,
                 fail: Callable[[list[str], str, str], None] = lambda ids, model, error: None) -> None:
        self.models, self.pool, self.stop, self.workers, self.use = models, pool, stop, workers, use
        self.loads = loads  # what the workers run (the top priority running: a reason to switch)
        self.fail = fail  # fails queued jobs (IDs, their model's name, the error) with load_failed
        self.failure: Optional[str] = None  # why this thread stopped the daemon (it exits 1)
        self.wake = threading.Event()
        self._cond = threading.Condition()
        self._parked = 0
        self._generation = 0  # counts switches: a parked worker waits for the next

    def run(self) -> None:
        _name_os_thread("Models")
        while not self.stop.is_set():
            self.wake.wait(0.1)
            self.wake.clear()
            if self.stop.is_set():  # (request_stop sets wake too): no switch or load begins now
                break
            try:
                self._tend_failures()
                heads = {queue: head for queue, head in self.pool.heads().items() if self.models.turn(queue)}
                target = self.models.choose(heads, self.pool.running() > 0, self.loads.top(), time.monotonic())
                if target is not None:
                    self._switch(target)
                elif self.models.config.load_ahead:
                    self.models.load_ahead(heads, self.workers, self.stop)
            except Exception as err:  # choose's own bug: the active model goes on
                log.error(f"model switch error: {err!r}")

    def _tend_failures(self) -> None:
        """Route again the jobs of failed models due for another try (or whose file changed);
        fail the jobs of models given up on, or leave them to another daemon that has the
        model loaded."""
        models = self.models
        if models.failures():
            self.pool.reroute(models.retries)
        for queue, failure, elsewhere in models.failures():
            if failure.due:  # chosen as any other queue (see _Models.turn)
                continue
            if failure.gave_up and not elsewhere:
                taken = self.pool.take_queue(queue)
                if taken:
                    self.fail(taken, models.served[queue].name,
                              f"{failure.error} ({failure.count} failed loads; NRVNA_MAX_LOAD_FAILURES is "
                              f"{models.config.max_load_failures}): fix or replace the file, then nrvna retry")
            else:
                self.pool.set_aside(queue)

    def _switch(self, queue: int) -> None:
        models = self.models
        previous = models.active
        self.pool.set_active(None)  # no worker takes a job now; each parks once its jobs end
        with self._cond:
            while self._parked < self.workers and not self.stop.is_set():
                self._cond.wait(0.1)
        if self.stop.is_set():
            return
        began = time.monotonic()
        try:
            self.use(models.activate(queue, self.workers, self.pool.heads()))
            log.info(f"Switched from model {models.served[previous].name} to {models.served[queue].name} "
                     f"({time.monotonic() - began:.2f} s)")
        except Exception as err:  # a broken file, out of memory: its jobs wait, then fail (see _LoadFailure)
            failure = models.failed_load(queue, err)
            if not failure.gave_up:  # (a given-up model's jobs stay queued here, for _tend_failures)
                self.pool.set_aside(queue)
            queue = previous
            try:  # the eviction that made room may have unloaded it
                self.use(models.activate(previous, self.workers, self.pool.heads()))
            except Exception as again:
                self.failure = f"model {models.served[previous].name} cannot be loaded again ({again})"
                log.error(f"{self.failure}; stopping")
                self.stop.set()
                self.pool.close()
                return
        self.pool.set_active(queue)
        with self._cond:  # every parked worker goes: none is counted until it parks again
            self._generation += 1
            self._parked = 0
            self._cond.notify_all()

    def park(self) -> None:
        """A worker with no job while a switch waits: wait here until it is done."""
        with self._cond:
            if self.pool.active is not None:  # the switch ended before this worker came to park
                return
            generation = self._generation
            self._parked += 1
            self._cond.notify_all()
            while self._generation == generation and not self.stop.is_set():
                self._cond.wait(0.1)

    def leave(self) -> None:
        """A worker thread ends: switches wait for one worker fewer."""
        with self._cond:
            self.workers -= 1
            self._cond.notify_all()

    def release(self) -> None:
        """The daemon stops: wake everyone waiting."""
        self.wake.set()
        with self._cond:
            self._cond.notify_all()


class _Models:
    """The models a daemon serves (a queue of the Pool each, by its index in ``served``):
    which model's queue a job goes to, which models are loaded (at most NRVNA_MAX_LOADED),
    and which one the workers run next.

    One model runs at a time, with every worker and core: two models decoding at once on
    one machine's cores or GPU only slow each other (measured: llama-server's router with
    three models loaded, 1.06 jobs/s against 9.21 for one model at a time). The others
    stay loaded, so switching back costs no load. ``choose`` says when to switch: see it.

    Threads: the routing state (``failed`` and its _LoadFailures, what the other daemons
    serve, the route cache) is read and written under ``_lock`` only: by the Scanner
    (``queue_of``, called under the Pool's lock), the Watcher (``peers``, under the Pool's
    lock; ``describe``, for status), the Models thread (``retries``, ``load_failed``,
    ``activate``, ``turn``, ``failures``). Nothing called under ``_lock`` takes another lock.
    The loaded models (``served[i].runner``, ``sessions``), ``active``, ``since`` and
    ``loads`` are changed by the Models thread alone (by the main thread before the daemon's
    threads start and after they stop); the workers read ``active`` only while the Pool has
    an active queue, which a switch clears, then waits for every worker to park, before
    it changes ``active`` (see _ModelSwitch); ``describe`` reads them as they are.
    """

    def __init__(self, names: Any, runner: Optional[Runner], config: Config, models_dir: str,
                 aliases: Mapping[str, str]) -> None:
        self.config, self.models_dir, self.aliases = config, models_dir, aliases
        names = [names] if isinstance(names, str) else list(names or [])
        folders = [n for n in names if _models_folder(n)]
        if folders:  # `daemon shelf/ WS`: jobs name shelf's models
            self.models_dir = os.path.abspath(folders[0])
        unreadable: dict[int, ModelError] = {}  # queues whose file's header cannot be read
        if runner is not None:
            self.served = [_ServedModel(runner.name, None, "chat", runner)]
        else:
            self.served = [self._served(p, i, unreadable) for i, p in enumerate(self._files(names))]
            if len(unreadable) == len(self.served):  # nothing to serve: refused at start, before the queue
                raise unreadable[0]
        # A job naming no model (or a name that matches none) goes to the first model that
        # serves its kind; with none here, it waits in ready/ for a daemon with one (a chat
        # model would only fail an embed job as unsupported, and the other way round).
        self.defaults = {kind: next((i for i, m in enumerate(self.served) if self._serves(m, kind)), None)
                         for kind in ("chat", "embed")}
        self.active = next(i for i in range(len(self.served)) if i not in unreadable)  # (start: the first that loads)
        self.since = time.monotonic()
        self.loads = 0
        self.base_mib = _resident_mib()  # the process before any model: NRVNA_MAX_MEMORY counts it
        self._lock = threading.Lock()  # the routing state's (see Threads above)
        self.failed: dict[int, _LoadFailure] = {}  # queues whose model could not be loaded at its turn
        # Queues whose model could not be loaded ahead of its turn (the Models thread's alone).
        self.early_failed: set[int] = set()
        self.kinds_elsewhere: set[str] = set()  # the kinds of model the workspace's other daemons serve
        self.paths_elsewhere: set[str] = set()  # the model files the other daemons have loaded
        self._routes: dict[tuple[str, bool], Optional[int]] = {}  # (name, embed) -> queue (a cache)
        self.states_owner = ""  # whose saved states the models' stores write and bound (see state_owner)
        for queue, error in unreadable.items():  # a failed load like any other: the other models serve
            self.failed_load(queue, error)

    @staticmethod
    def _served(path: str, queue: int, unreadable: dict[int, ModelError]) -> _ServedModel:
        """``path`` as a served model; a file whose header cannot be read (not a GGUF, a header
        out of bounds: check_gguf) is one of kind "unknown", its error put in ``unreadable``:
        jobs naming no model never go to it."""
        try:
            check_gguf(path)
            kind = gguf_kind(path)
        except ModelError as err:
            unreadable[queue], kind = err, "unknown"
        return _ServedModel(os.path.basename(path), os.path.realpath(path), kind)

    def _files(self, names: list[str]) -> list[str]:
        """The model files MODEL arguments name: a directory's *.gguf, or each name resolved."""
        if not names:
            raise ModelError("no model given")
        files: list[str] = []
        for name in names:
            if _models_folder(name):
                found = gguf_files(name)
                if not found:
                    raise ModelError(f"models directory {name} holds no *.gguf file")
                files += [os.path.join(name, f) for f in found]
            else:
                files.append(resolve_model(name, self.models_dir, self.aliases))
        unique = {os.path.realpath(f): f for f in reversed(files)}  # the same file twice is one model
        files = [f for f in files if unique.get(os.path.realpath(f)) is f]
        return files

    def _serves(self, model: _ServedModel, kind: str) -> bool:
        """Whether ``model`` runs jobs of ``kind`` that name no model: one of that kind, an
        injected runner (it decides), or a chat model that NRVNA_POOLING lets embed."""
        return (model.kind == kind or model.path is None
                or (kind == "embed" and model.kind == "chat" and self.config.pooling in ("mean", "cls", "last")))

    def kinds(self) -> list[str]:
        """The kinds of job naming no model this daemon runs (its record says, for status)."""
        return [kind for kind, queue in self.defaults.items() if queue is not None]

    def queue_of(self, name: Optional[str], embed: bool) -> Optional[int]:
        """The queue of a job naming model ``name`` (an embed job, or not); None when it names
        a model this daemon does not serve, or names none and no model here serves its kind
        (or only through NRVNA_POOLING while another daemon has a model of its kind), or its
        model could not be loaded here (see _LoadFailure): it waits in ready/."""
        key = (name or "", embed)
        with self._lock:
            queue = self._routes.get(key, -1)
            if queue != -1:
                return queue if self._takes(queue) else None
            path = model_file(name, self.models_dir, self.aliases) if name is not None else None
            if path is not None:  # a job naming one model goes to it, here or in another daemon
                queue = next((i for i, m in enumerate(self.served) if m.path == path), None)
                if queue is None:
                    log.info(f"Jobs for model {name} ({path}) wait in the queue: this daemon serves "
                             f"{', '.join(m.name for m in self.served)}")
            else:  # the first model of its kind, unless only another daemon has one
                kind = "embed" if embed else "chat"
                queue = self.defaults[kind]
                if queue is not None and self.served[queue].kind != kind and kind in self.kinds_elsewhere:
                    queue = None
            if len(self._routes) < 4096:
                self._routes[key] = queue
            return queue if self._takes(queue) else None

    def _takes(self, queue: Optional[int]) -> bool:
        """Whether ``queue``'s jobs are queued here now: not while its model, which failed to
        load, waits for its next try, nor while another daemon has it loaded (under _lock)."""
        failure = self.failed.get(queue) if queue is not None else None
        if failure is None:
            return queue is not None
        return (failure.due or failure.gave_up) and self.served[queue].path not in self.paths_elsewhere

    def peers(self, kinds: set[str], paths: Optional[set[str]] = None) -> bool:
        """The other daemons now serve models of ``kinds`` and have the model files ``paths``
        loaded; True if that changes any route."""
        with self._lock:
            paths = self.paths_elsewhere if paths is None else paths
            if kinds == self.kinds_elsewhere and paths == self.paths_elsewhere:
                return False
            self.kinds_elsewhere, self.paths_elsewhere = kinds, paths
            self._routes.clear()
            return True

    def load_failed(self, queue: int, error: str) -> _LoadFailure:
        """``queue``'s model could not be loaded at its turn (see _LoadFailure)."""
        with self._lock:
            failure = self.failed.setdefault(queue, _LoadFailure(self.served[queue].path))
            failure.failed(error, self.config.max_load_failures)
            return failure

    def failed_load(self, queue: int, error: Exception) -> _LoadFailure:
        """``load_failed``, logged with what happens next to its jobs."""
        failure = self.load_failed(queue, str(error))
        if failure.gave_up:
            then = f"its queued jobs fail (load_failed): {failure.count} failed loads"
        else:
            then = (f"its jobs wait; tried again in {failure.retry_at - time.monotonic():.0f} s "
                    f"({failure.count} of NRVNA_MAX_LOAD_FAILURES {self.config.max_load_failures} failed "
                    "loads), or start a daemon for it")
        log.error(f"model {self.served[queue].name} could not be made ready ({error}); {then}")
        return failure

    def start(self, workers: int) -> list[Session]:
        """Activate the first model that loads, at the daemon's start (before its threads): one
        that cannot be read or loaded is a failed load as at its turn, its jobs waiting (see
        _LoadFailure), while another serves. Raises the first model's error when none loads."""
        errors: list[tuple[int, ModelError]] = []
        for queue in range(len(self.served)):
            if queue in self.failed:  # its header could not be read
                continue
            try:
                sessions = self.activate(queue, workers, ())
            except ModelError as err:
                errors.append((queue, err))
                continue
            for failed, err in errors:
                self.failed_load(failed, err)
            return sessions
        raise errors[0][1] if errors else ModelError("no model of this daemon can be loaded")

    def failures(self) -> list[tuple[int, _LoadFailure, bool]]:
        """Each queue whose model failed to load: its _LoadFailure, and whether another daemon
        has that model loaded."""
        with self._lock:
            return [(queue, failure, self.served[queue].path in self.paths_elsewhere)
                    for queue, failure in self.failed.items()]

    def retries(self) -> bool:
        """Make the failed models whose next try is due, or whose file changed since it
        failed, take their jobs again; True if any did (their jobs are routed again)."""
        now, changed = time.monotonic(), False
        with self._lock:
            for queue, failure in list(self.failed.items()):
                model = self.served[queue]
                if _file_signature(model.path) != failure.signature:
                    log.info(f"Model file {model.path} changed since it failed to load; trying it again")
                    del self.failed[queue]
                    self.early_failed.discard(queue)
                    changed = True
                elif not failure.due and not failure.gave_up and now >= failure.retry_at:
                    log.info(f"Trying model {model.name} again (it failed to load {failure.count} times)")
                    failure.due = changed = True
            if changed:
                self._routes.clear()
        return changed

    def turn(self, queue: int) -> bool:
        """Whether ``queue`` may be chosen to run: not while its model is failed, unless a try is due."""
        with self._lock:
            failure = self.failed.get(queue)
            return failure is None or failure.due

    def choose(self, heads: Mapping[int, _QueueHead], running: bool, running_top: Optional[int],
               now: float) -> Optional[int]:
        """The model to switch to now, or None to keep the active one. The active model keeps
        the workers while it has jobs queued or running, so each is loaded once per backlog,
        not once per job. Another model takes over (once the active model's running jobs
        end) when it has a job above all the active model's, or when the active model has
        had NRVNA_MODEL_TURN seconds while others waited: no model's jobs starve. The next
        model is the one with the highest job, then a loaded one, then the one whose next job
        is oldest."""
        waiting = [queue for queue in heads if queue != self.active]
        if not waiting:
            return None
        mine = [heads[self.active].top] if self.active in heads else []
        if running and running_top is not None:
            mine.append(running_top)
        if not mine:
            return self._best(heads, waiting)
        above = [queue for queue in waiting if heads[queue].top > max(mine)]
        if above:
            return self._best(heads, above)
        if now - self.since >= self.config.model_turn:
            return self._best(heads, waiting)
        return None

    def _best(self, heads: Mapping[int, _QueueHead], candidates: list[int]) -> int:
        return min(candidates, key=lambda queue: (-heads[queue].top, self.served[queue].runner is None,
                                                  heads[queue].next_key))

    def load_ahead(self, heads: Mapping[int, _QueueHead], workers: int, stop: threading.Event) -> bool:
        """Load the model whose jobs come next (as ``choose`` would pick it) while the active
        one runs, so that its turn starts without a load; True if it loaded one. Only into
        the room NRVNA_MAX_LOADED leaves: it unloads nothing, as a model with nothing queued
        now may be the next one needed (a job of a higher priority), and unloading it early would
        cost a load (a review traced two per such job). ``stop`` cuts the load short. A
        model that fails here is not tried again ahead of its turn: its turn tries, and says
        why."""
        with self._lock:
            waiting = [queue for queue in heads if queue != self.active and queue not in self.failed]
        if not waiting or sum(m.runner is not None for m in self.served) >= self.config.max_loaded:
            return False
        queue = self._best(heads, waiting)
        model = self.served[queue]
        if model.runner is not None or queue in self.early_failed:
            return False
        try:
            self._load(model, workers, " (ahead of its turn)", cancel=stop)
        except Exception as err:  # out of memory beside the active model, say
            if not stop.is_set():
                log.warning(f"model {model.name} could not be loaded ahead of its turn ({err}); it is tried "
                            "again at its turn")
                self.early_failed.add(queue)
            return False
        return True

    def activate(self, queue: int, workers: int, queued: Iterable[int]) -> list[Session]:
        """Make ``queue``'s model the active one and return its sessions, loading it first
        (and evicting the least recently used loaded model with nothing ``queued``, then
        any, to stay within NRVNA_MAX_LOADED). Raises ModelError when it cannot be loaded."""
        model = self.served[queue]
        if model.runner is None and model.path is not None:
            check_gguf(model.path)  # (a header read again: nothing is unloaded for a file that cannot be read)
        if model.runner is None:
            loaded = [m for m in self.served if m.runner is not None and m is not model]
            busy = set(queued)
            while loaded and len(loaded) >= self.config.max_loaded:
                victim = min(loaded, key=lambda m: (self.served.index(m) in busy, m.used))
                log.info(f"Unloading model {victim.name}")
                self._unload(victim)
                loaded.remove(victim)
        self._load(model, workers)
        with self._lock:
            self.failed.pop(queue, None)
        self.active, self.since = queue, time.monotonic()
        model.used = self.since
        return model.sessions

    def _load(self, model: _ServedModel, workers: int, why: str = "", cancel: Optional[threading.Event] = None) -> None:
        """Load ``model`` (unless it is) and its ``workers`` sessions (unless it has them); on
        failure nothing of it stays loaded, and the error is raised."""
        if model.runner is None:
            log.info(f"Loading model {model.path}{why}")
            model.runner = LlamaRunner(model.path, self.config, cancel=cancel, owner=self.states_owner)
            self.loads += 1
        if not model.sessions:
            try:
                sessions = [model.runner.session(0, self.config)]
                report = model.runner.memory()
                if report is not None:  # the budget holds before the other contexts are made
                    others = sum((m.runner.memory() or {}).get("total_mib", 0.0) for m in self.served
                                 if m is not model and m.runner is not None)
                    check_memory_budget(self.config, model.name, report, workers, self.base_mib + others,
                                        getattr(model.runner, "store", None) is not None)
                sessions += [model.runner.session(i, self.config) for i in range(1, workers)]
                model.sessions = sessions
            except BaseException:
                self._unload(model)
                raise
            report = model.runner.memory()
            if report is not None:
                log.info(memory_line(model.name, report))

    def _unload(self, model: _ServedModel) -> None:
        if model.runner is not None:
            model.runner.close()  # closes its sessions too
        model.sessions = []
        if model.path is not None:  # an injected runner stays (its caller made it)
            model.runner = None

    def close(self) -> None:
        for model in self.served:
            self._unload(model)

    def describe(self) -> list[dict[str, Any]]:
        """Each model as the daemon's record lists it."""
        described = []
        runners = [(m.runner, bool(m.sessions)) for m in self.served]  # as they are: a switch may change them
        reports = [runner.memory() if runner is not None and loaded else None for runner, loaded in runners]
        with self._lock:
            for i, m in enumerate(self.served):
                described.append({"name": m.name, "path": m.path, "kind": m.kind, "loaded": bool(m.sessions),
                                  "active": i == self.active})
                if reports[i] is not None:
                    described[-1]["memory"] = reports[i]
                failure = self.failed.get(i)
                if failure is not None:  # status and wait tell the jobs waiting for it why
                    described[-1].update(load_failures=failure.count, load_error=failure.error,
                                         max_load_failures=self.config.max_load_failures,
                                         retry_at=None if failure.gave_up else round(failure.wall, 3))
        return described


# ============================================================================
# 12.5 Daemons side by side, and the watch
# ============================================================================
# _clash and _hooks_clash refuse a daemon that would fight another; _Registry keeps this daemon's
# record beside the others'; _Watcher applies cancels and timeouts, flushes partial.txt and
# requeues the jobs of daemons that died.


def _clash(mine: list[dict[str, Any]], gpu: int, other: dict[str, Any]) -> Optional[str]:
    """Why a live daemon's record excludes a daemon serving ``mine`` (_Models.describe) on
    ``gpu``: the other serves one of the same models on the same GPU (or both on the CPU),
    where a second copy would only halve the first."""
    theirs = other.get("gpu") if isinstance(other.get("gpu"), int) else -1
    if max(theirs, -1) != max(gpu, -1) or other.get("starting"):
        return None
    # A model the other could not load is no clash: a daemon for it is what its jobs wait for.
    same = sorted({m["path"] or m["name"] for m in mine}
                  & {m.get("path") or m.get("name") for m in other.get("models") or ()
                     if isinstance(m, dict) and not m.get("load_failures")})
    if not same:
        return None
    where = f"GPU {gpu}" if gpu >= 0 else "this machine's CPU (or its default GPUs)"
    return (f"serving {', '.join(map(os.path.basename, same))} on {where}; another GPU (--gpu N) or another "
            "model may be served beside it")


def _hooks_clash(mine: dict[str, str], other: dict[str, Any]) -> Optional[str]:
    """Why a live daemon's record excludes a daemon with hooks ``mine`` ({"on_done",
    "on_batch_done"}): one daemon at a time runs a workspace's hooks, with its own commands
    (Hooks._take_turn), so a second set would be dropped silently. A daemon without hooks runs
    none and is welcome beside any (it records its jobs' ends for the one that runs them)."""
    theirs = other.get("hooks")
    if not isinstance(theirs, dict) or not any(theirs.values()) or not any(mine.values()):
        return None
    theirs = {name: theirs.get(name) or "" for name in mine}
    if theirs == mine:
        return None
    shown = ", ".join(f"--{name.replace('_', '-')} {theirs[name]!r}" for name in mine)
    return (f"with other hooks ({shown}): one daemon runs every hook of a workspace, with its own commands; "
            "start this one with the same --on-done and --on-batch-done, or with none")


class _Registry:
    """A daemon's place among the daemons of its workspace: its lock in daemons/ (the proof
    that it lives), its record beside it (what ``status --daemon`` lists), and the watch for
    daemons that died, whose running jobs it requeues at once.

    Threads: the main thread registers and releases (before the daemon's threads start and
    after they stop) and looks for the dead at start; then the Watcher keeps the lock and
    looks for the dead. The record is written by the Watcher and, at a drain, the main
    thread: ``write`` and ``keep`` (which renames the record) are under ``_lock``.
    """

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self.folder = os.path.join(workspace, DAEMONS)
        self.name = ""
        self._fd: Optional[int] = None
        self._lock = threading.Lock()  # one writer of the record at a time (its temporary name is fixed)

    def register(self, record: Callable[[], dict[str, Any]], clash: Callable[[dict[str, Any]], Optional[str]]) -> None:
        """Take this daemon's lock and write its record, unless ``clash`` names a reason a live
        daemon excludes it (WorkspaceError). Under the WorkspaceLock: two daemons starting
        at once see each other."""
        try:
            held = _locked(open_dir(self.workspace), exclusive=False)
        except OSError as err:
            raise WorkspaceError(f"workspace {self.workspace} cannot be locked: {_os_error(err)}") from None
        if held is None:
            raise WorkspaceError(f"workspace {self.workspace} is in use by a daemon of an earlier nrvna version "
                                 "(it holds the workspace directory's lock); stop it first")
        os.close(held)
        with WorkspaceLock(self.workspace):
            for other in daemon_records(self.workspace):
                reason = clash(other)
                if reason:
                    raise WorkspaceError(f"workspace {self.workspace} is in use by another daemon (pid "
                                         f"{other.get('pid')}) {reason}")
            try:
                self._fd, self.name = register_daemon(self.workspace)
                self.write(record())
            except OSError as err:
                self.release()
                raise WorkspaceError(f"workspace {self.workspace} is not writable: {_os_error(err)}") from None

    def write(self, record: dict[str, Any]) -> None:
        """Rewrite the record atomically (no fsync: it is for watching, not state)."""
        import json

        data = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()
        with self._lock:
            fd = open_dir(self.folder)
            try:
                write_file(fd, f"{self.name}.json", data, sync=False)
            finally:
                os.close(fd)

    def keep(self) -> None:
        """Put the lock file back if it was removed or replaced (the lock held is on the old
        file: the others would take this daemon for dead and list it no more)."""
        if self._fd is not None and not _same_entry(self._fd, os.path.join(self.folder, f"{self.name}.lock")):
            log.warning(f"{DAEMONS}/{self.name}.lock was removed or replaced; taking it again")
            fd, name = register_daemon(self.workspace)
            with self._lock:
                old = self.name
                self._release_files()
                os.close(self._fd)
                self._fd, self.name = fd, name
            log.info(f"This daemon is now {name} (was {old})")

    def dead(self) -> Iterator[str]:
        """The daemons that died (their locks are free): each is forgotten (its files removed,
        so no listing shows it) and held, so no other daemon reaps it too, while the caller
        recovers the jobs it ran."""
        for name in _daemon_locks(self.workspace):
            if name == self.name:
                continue
            fd = _dead_daemon_lock(self.workspace, name, exclusive=True)
            if fd is None or fd < 0:
                continue
            try:
                for leftover in (f"{name}.lock", f"{name}.json", f".{name}.json.tmp"):
                    _unlink_quietly(os.path.join(self.folder, leftover), None)
                yield name
            finally:
                os.close(fd)

    def _release_files(self) -> None:
        for leftover in (f"{self.name}.json", f"{self.name}.lock"):
            _unlink_quietly(os.path.join(self.folder, leftover), None)

    def release(self) -> None:
        """Remove the record and let go of the lock (the daemon has stopped)."""
        if self._fd is not None:
            self._release_files()
            os.close(self._fd)
            self._fd = None


class _Watcher:
    """A daemon's Watcher thread, every WATCH_SECONDS: sees cancel requests and timeouts of
    running jobs and appends their new text to partial.txt; every REAP_SECONDS looks for
    daemons of the workspace that died and requeues their running jobs; every
    DAEMON_STATUS_SECONDS rewrites this daemon's record; every REAP_SECONDS also releases the
    children whose parent ended elsewhere (another daemon, a cancel). (Off the workers' threads: decoding
    never waits for this I/O.)

    Threads: its own (Watcher) alone, after the main thread made it (``peer_models`` too, at
    start); each running job it sees it only flags (``interrupt``, one attribute its worker
    reads between tokens) and flushes through the Processor (under the job's claim lock).
    """

    def __init__(self, workspace: str, registry: _Registry, processor: Processor, recovery: _Recovery, pool: Pool,
                 models: _Models, running: Callable[[], list[RunningJob]], write_status: Callable[[], None]) -> None:
        self.workspace, self.registry, self.processor, self.recovery = workspace, registry, processor, recovery
        self.pool, self.models = pool, models
        self.running, self.write_status = running, write_status
        self._next_reap = 0.0
        self._next_orphans = time.monotonic() + ORPHAN_SECONDS
        self._next_status = 0.0

    def run(self, stop: threading.Event) -> None:
        _name_os_thread("Watcher")
        while not stop.wait(WATCH_SECONDS):
            try:
                self.round()
            except Exception as err:  # bookkeeping must never take the daemon down
                log.limited(f"watcher:{type(err).__name__}", f"watcher error: {err!r}")

    def round(self) -> None:
        now = time.monotonic()
        for job in self.running():
            if job.interrupt is None:
                timeout = job_param(job.params, "timeout")
                if timeout is not None and now - job.started > timeout:
                    job.interrupt = ("timeout", f"generation took longer than its timeout of {timeout:g} s")
                elif self.processor.cancel_requested(job):
                    job.interrupt = ("cancelled", "cancelled while running (nrvna cancel)")
            self.processor.flush_partial(job)
        if now >= self._next_reap:
            self._next_reap = now + REAP_SECONDS
            self._reap(now)
        if now >= self._next_status:
            self._next_status = now + DAEMON_STATUS_SECONDS
            self.registry.keep()
            self.processor.daemon = self.registry.name  # (a new name, if its lock file was replaced)
            self.write_status()

    def _reap(self, now: float) -> None:
        """Requeue at once the running jobs of daemons that died (their locks are free), and
        every ORPHAN_SECONDS any job in processing/ that nobody holds (a requeue or a reaping
        that failed); route again the jobs left for others when the other daemons' kinds of
        model change, and forget those that others ran."""
        dead = list(self.registry.dead())
        for name in dead:
            log.warning(f"Daemon {name} died; requeuing the jobs it was running")
        if dead or now >= self._next_orphans:
            self._next_orphans = now + ORPHAN_SECONDS
            recovered = self.recovery.recover()
            if recovered:
                log.info(f"Requeued {len(recovered)} jobs that no live daemon held")
            if not dead:
                self.pool.forget_gone(set(os.listdir(os.path.join(self.workspace, READY))))
        # Children whose parent ended in another daemon, or was cancelled while queued.
        self.pool.release_finished(lambda parent: parent_unfinished(self.workspace, parent))
        kinds, paths = self.peer_models()
        self.pool.reroute(lambda: self.models.peers(kinds, paths))

    def peer_models(self) -> tuple[set[str], set[str]]:
        """The kinds of model ("chat", "embed") the workspace's other live daemons serve, and
        their model files (those they could not load left out)."""
        others = [r for r in daemon_records(self.workspace) if r.get("name") != self.registry.name]
        models = [m for r in others for m in r.get("models") or () if isinstance(m, dict) and not m.get("load_failures")]
        return ({m["kind"] for m in models if m.get("kind") in ("chat", "embed")},
                {m["path"] for m in models if isinstance(m.get("path"), str)})


# ============================================================================
# 12.6 Server
# ============================================================================
# _WorkerLoads (each worker's load and top priority, under one lock) and Server: it starts
# every thread, runs the workers' loop and the Finisher, and stops them in order.


class _WorkerLoads:
    """What each worker runs, as the others see it: its load (sequences in flight) and its
    top (its highest running priority; None: idle, or between steps). A worker leaves a job
    to one running fewer sequences, lends its threads to the busy ones (Server._share_cores),
    and pauses while another runs a job above all of its own.

    Threads: each worker writes its own entries and reads the others'; the Models thread
    reads the top (a reason to switch models), the Scanner the tops (Server._outranked, when
    a job is queued). All under ``_lock``, held for a list operation only.
    """

    def __init__(self, workers: int = 0) -> None:
        self._lock = threading.Lock()
        self._loads = [0] * workers
        self._tops: list[Optional[int]] = [None] * workers

    def set_load(self, index: int, load: int) -> None:
        with self._lock:
            self._loads[index] = load

    def set_top(self, index: int, top: Optional[int]) -> None:
        with self._lock:
            self._tops[index] = top

    def add(self, index: int) -> None:
        """Worker ``index`` runs one sequence more."""
        with self._lock:
            self._loads[index] += 1

    def lighter(self, index: int, load: int) -> bool:
        """Whether another worker runs fewer than ``load`` sequences."""
        with self._lock:
            return any(other < load for i, other in enumerate(self._loads) if i != index)

    def top(self) -> Optional[int]:
        """The highest priority any worker runs; None if all are idle."""
        with self._lock:
            return max((top for top in self._tops if top is not None), default=None)

    def outranked(self, priority: int) -> bool:
        """Whether a worker runs a job above ``priority``."""
        with self._lock:
            return any(top is not None and top > priority for top in self._tops)

    def below(self, priority: int) -> list[int]:
        """The workers whose jobs are all below ``priority``."""
        with self._lock:
            return [i for i, top in enumerate(self._tops) if top is not None and top < priority]

    def share(self, index: int, budget: int) -> int:
        """Worker ``index``'s share of ``budget`` threads among the workers with jobs (and it)."""
        with self._lock:
            busy = [i for i, load in enumerate(self._loads) if load > 0 or i == index]
        share, extra = divmod(budget, len(busy))
        return share + (busy.index(index) < extra)


def _warn_if_shared(workspace: str) -> None:
    mode = os.stat(workspace).st_mode
    if mode & 0o022:
        log.warning(f"workspace {workspace} is writable by group or others (mode "
                    f"{stat.S_IMODE(mode):o}): anyone who can write it can inject jobs; chmod 700 it")


def _claim_later(pool: Pool, job_id: str, err: Exception) -> None:
    """A claim that could not be made now: the job goes back to ``pool``, to be claimed again
    later, or to wait for its parent (retried since the job was routed)."""
    if isinstance(err, _ParentWaits):
        pool.wait_for(job_id, err.parent)
    elif isinstance(err, _Busy):  # another claimer (it takes it), or a requeue not yet done with it
        pool.retry_later(job_id, 0.05)
    elif isinstance(err, _HandBack):  # an I/O error; back in ready/ as it was
        pool.retry_later(job_id, 1.0)
    elif isinstance(err, OSError):  # the claim rename failed: still in ready/
        log.limited(f"claim rename:{err.errno}", f"cannot claim {job_id}: {_os_error(err)}; retrying in 2 s")
        pool.retry_later(job_id, 2.0)
    else:  # the WorkspaceLock of a quarantine could not be taken
        log.error(f"cannot claim {job_id}: {err}; retrying in 2 s")
        pool.retry_later(job_id, 2.0)


def _with_states_folder(config: Config, workspace: str) -> Config:
    """``config`` with the folder of the saved KV states: the workspace's own unless
    NRVNA_CACHE_DIR names one (a copy: a Config given for several workspaces keeps its own)."""
    if config.cache_dir:
        return config
    import copy

    config = copy.copy(config)
    config.cache_dir = states_folder(os.path.abspath(workspace))
    return config


def _signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


class Server:
    """The daemon: registers among the workspace's daemons, loads its (first) model, recovers
    orphans, then runs one Scanner thread and N worker threads (``Worker-0``...) until
    ``shutdown()``; serving several models, a ``Models`` thread switches between them.

    ``model``: a GGUF path or name, a directory of GGUFs, or a list of them (see _Models).
    ``runner`` replaces llama.cpp (tests, custom back-ends): a ``FunctionRunner`` or any
    callable ``fn(job) -> str``. ``drain=True`` stops by itself once the queue is empty.

    Threads: the main thread starts, serves (``serve_forever``), stops and shuts down; the
    workers, the Finisher and the Models thread (``_fail_unloadable``) end jobs; the Watcher
    reads the running jobs and the record (``status``); the Scanner calls ``_route`` and
    ``_queued``. The running jobs and the figures are under ``_stats_lock``, the workers'
    loads under _WorkerLoads'. ``_sessions`` and ``_thread_budget`` change only in ``_use``:
    at start, and on the Models thread while every worker is parked (see _ModelSwitch).
    """

    def __init__(self, model: Any, workspace: Any, workers: Optional[int] = None, *,
                 runner: Any = None, config: Optional[Config] = None, drain: bool = False) -> None:
        self.config = config if config is not None else Config.from_env()
        if workers is not None:
            self.config.workers = _check_setting("workers", workers)
        self.model = model
        self.workspace = os.fspath(workspace)
        self.config = _with_states_folder(self.config, self.workspace)
        if runner is not None and not isinstance(runner, Runner):
            if not callable(runner):
                raise TypeError("runner must be a Runner or a function fn(job) -> str")
            runner = FunctionRunner(runner)
        self.runner = runner
        self.drain = drain
        self.stranded = 0  # --drain: the jobs it stopped with queued that no live daemon serves (it exits 1)
        self.pool = Pool(self._route, self._queued)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loads = _WorkerLoads()
        self._sessions: list[Session] = []
        self._thread_budget = 0  # threads the workers' contexts share; 0: no lending
        self.registry = _Registry(self.workspace)
        self.models: Optional[_Models] = None
        self.switch: Optional[_ModelSwitch] = None  # serving several models: the Models thread
        self.watcher: Optional[_Watcher] = None
        self.scanner: Optional[Scanner] = None
        self.processor: Optional[Processor] = None
        self.started = False
        self._running: dict[str, RunningJob] = {}  # in flight, for the watcher (under _stats_lock)
        self._finishing: Any = None  # (job, outcome) for the Finisher thread; None ends it
        self._finisher: Optional[threading.Thread] = None
        self._stats_lock = threading.Lock()
        self._stats = {"jobs_done": 0, "jobs_failed": 0, "tokens_generated": 0}
        self._recent: Any = deque()  # (time, tokens) of jobs ended in the last minute
        self._started_at = time.time()
        self.hooks: Optional[Hooks] = None
        self._signalled: Optional[int] = None  # see stop_from_signal
        self._models_dir = os.path.abspath(self.config.models_dir)
        self._aliases = parse_aliases(self.config.model_aliases)

    def _route(self, job_id: str) -> Optional[_Place]:
        """Where a queued job goes, or None when it names a model this daemon does not serve:
        the job waits in ready/ for a daemon that does (read once per job: see Pool)."""
        route = read_route(job_path(self.workspace, READY, job_id))
        queue = self.models.queue_of(route.model, route.embed) if self.models else 0
        if queue is None:
            return None
        return _Place(route.priority, queue, route.parent if parent_unfinished(self.workspace, route.parent) else None)

    def _queued(self, priority: int, queue: int) -> None:
        if queue == self.pool.active:
            self._outranked(priority)
        elif self.switch is not None:
            self.switch.wake.set()  # another model's job: perhaps a reason to switch

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Check everything, take the workspace, load the model, recover, start threads.
        Raises NrvnaError with a one-line reason; on failure nothing is left running."""
        self.models = models = _Models(self.model, self.runner, self.config, self._models_dir, self._aliases)
        models.states_owner = state_owner(self.workspace)
        self._models_dir = models.models_dir
        ensure_workspace(self.workspace)
        hooks = {"on_done": self.config.on_done, "on_batch_done": self.config.on_batch_done}
        self.registry.register(self.status, lambda other: _clash(models.describe(), self.config.gpu, other)
                               or _hooks_clash(hooks, other))
        try:
            _warn_if_shared(self.workspace)
            for name in self.registry.dead():  # their files only: this start's recovery takes their jobs
                log.info(f"Daemon {name} had died; forgetting it")
            sessions = models.start(self.config.workers)
            self.pool.set_active(models.active)  # (not the first model, when it could not be loaded)
            self.processor = Processor(self.workspace, self.config, models.served[models.active].name)
            self.processor.daemon = self.registry.name
            if self.config.on_done or self.config.on_batch_done:
                self.hooks = Hooks(self.workspace, self.config, self._stop)
                self.hooks.prepare()
            else:
                owed = _folder_entries(self.workspace, HOOKS_OWED)
                if owed:
                    log.warning(f"{len(owed)} jobs' hooks are owed (hooks/done/); they run when a daemon starts "
                                "with --on-done or --on-batch-done (delete hooks/ to forget them)")
            log.info("Recovering orphaned jobs...")
            recovery = _Recovery(self.processor)
            recovered = recovery.recover()
            recovery.clean_staging()
            recovery.run_last_chances(recovered, sessions[0], self._stop,
                                      lambda job_id: (self._route(job_id) or _Place(0, None)).queue == models.active)
            self.watcher = _Watcher(self.workspace, self.registry, self.processor, recovery, self.pool, models,
                                    self._running_jobs, self.write_status)
            models.peers(*self.watcher.peer_models())  # before the first scan routes a job
            self.scanner = Scanner(self.workspace, self.pool, self._stop)
        except BaseException:
            self.hooks = None
            models.close()
            self.registry.release()
            raise
        self._started_at = time.time()
        self._threads = [threading.Thread(target=self.scanner.run, name="Scanner", daemon=True),
                         threading.Thread(target=self.watcher.run, args=(self._stop,), name="Watcher", daemon=True)]
        self._loads = _WorkerLoads(len(sessions))
        if len(models.served) > 1:
            self.switch = _ModelSwitch(models, self.pool, self._stop, len(sessions), self._use, self._loads,
                                       self._fail_unloadable)
            self._threads.append(threading.Thread(target=self.switch.run, name="Models", daemon=True))
        self._use(sessions)
        for index in range(len(sessions)):
            self._threads.append(threading.Thread(target=self._work, args=(index,), name=f"Worker-{index}", daemon=True))
        import queue

        self._finishing = queue.SimpleQueue()
        self._finisher = threading.Thread(target=self._finish_loop, name="Finisher", daemon=True)
        self._finisher.start()
        for thread in self._threads:
            thread.start()
        if self.hooks is not None:
            self.hooks.start()
        self.started = True
        log.info(f"Server started: {self.workspace}, {self.config.workers} workers x "
                 f"{self.config.seqs} sequences, pid {os.getpid()}")
        log.info("Host caches: " + "; ".join(f"{what}: {bound}" for what, bound in host_caches(self.config).items()))

    def _use(self, sessions: list[Session]) -> None:
        """Make ``sessions`` (one per worker) the ones the workers step."""
        self._sessions = sessions
        # Threads are lent only between one-thread contexts: then the lender's thread, the
        # one wide thread, is the only OpenMP team (see LlamaRunner.decode_wide).
        lending = len(sessions) > 1 and all(s.base_threads == 1 for s in sessions)
        self._thread_budget = len(sessions) if lending else 0

    def request_stop(self) -> None:
        """Ask every thread to stop; ``shutdown`` waits. From a signal handler while
        ``serve_forever`` runs, call ``stop_from_signal`` instead."""
        self._stop.set()
        self.pool.close()
        if self.switch is not None:
            self.switch.release()
        if self.scanner is not None:
            self.scanner.wake()

    def stop_from_signal(self, signum: int) -> None:
        """``request_stop`` for a signal handler: sets a field and takes no lock, because the
        handler runs on the main thread, which may be inside ``serve_forever`` holding a lock
        that ``request_stop`` takes (an Event's, the Pool's): taking it again would hang the
        daemon for good. ``serve_forever`` stops within its poll."""
        self._signalled = signum

    def serve_forever(self, poll: float = 0.1) -> None:
        """Block until a stop is requested (or, with ``drain``, until the queue is empty)."""
        while not self._stop.is_set():
            time.sleep(poll)
            if self._signalled is not None:
                log.info(f"Received {_signal_name(self._signalled)}")
                self.request_stop()
            elif self.drain and self._drained() and (self.hooks is None or self.hooks.idle()):
                log.info("Queue drained")
                self._say_stranded()
                self.request_stop()

    def _say_stranded(self) -> None:
        """--drain stops: say which jobs it leaves queued that no live daemon serves (a model
        nobody serves or could load, a kind no model serves), by reason; it then exits 1."""
        left = sorted((j for j in _folder_entries(self.workspace, READY) if j in self.pool.elsewhere), key=order_key)
        if left:
            self.write_status()  # the reasons read this record too: a load may have failed since its last write
        reasons: dict[str, list[str]] = {}
        for job_id, reason in waiting_for_model(self.workspace, left).items():
            reasons.setdefault(reason, []).append(job_id)
        for reason, ids in reasons.items():
            log.error(f"{len(ids)} jobs left queued ({ids[0]}{', ...' if len(ids) > 1 else ''}): {reason}")
        self.stranded = sum(map(len, reasons.values()))

    def failure(self) -> Optional[str]:
        """Why the daemon stopped as it should not have (it exits 1), or None."""
        if self.switch is not None and self.switch.failure:
            return self.switch.failure
        return f"{self.stranded} jobs left queued that no live daemon serves" if self.stranded else None

    def _running_jobs(self) -> list[RunningJob]:
        with self._stats_lock:
            return list(self._running.values())

    def status(self) -> dict[str, Any]:
        """This daemon's record (what ``nrvna status WS --daemon`` lists)."""
        now = time.time()
        with self._stats_lock:
            while self._recent and now - self._recent[0][0] > 60:
                self._recent.popleft()
            window = min(60.0, max(1.0, now - self._started_at))
            recent = sum(tokens for _, tokens in self._recent)
            models = self.models.describe() if self.models else []
            default = models[0] if models else {}
            return dict(self._stats, pid=os.getpid(), name=self.registry.name, models=models,
                        model=next((m["name"] for m in models if m["active"]), None), model_path=default.get("path"),
                        kinds=self.models.kinds() if self.models else [],
                        loads=self.models.loads if self.models else 0, models_dir=self._models_dir,
                        aliases=self._aliases, gpu=self.config.gpu, workers=self.config.workers, seqs=self.config.seqs,
                        hooks={"on_done": self.config.on_done, "on_batch_done": self.config.on_batch_done},
                        kv_type=self.config.kv_type, max_memory=self.config.max_memory, caches=host_caches(self.config),
                        started=round(self._started_at, 3), updated=round(now, 3), running=len(self._running),
                        tokens_per_second_last_minute=round(recent / window, 1))

    def write_status(self) -> None:
        """Rewrite this daemon's record in daemons/ atomically."""
        self.registry.write(self.status())

    def _drained(self) -> bool:
        if not self.pool.idle() or self.scanner is None or self.scanner.scans == 0 or self.pool.active is None:
            return False
        waiting = self.pool.waiting_children()
        with os.scandir(os.path.join(self.workspace, READY)) as entries:
            if not any(not e.name.startswith(".") and e.name not in self.pool.elsewhere and e.name not in waiting
                       for e in entries):
                return True  # what is left waits for a model served elsewhere, or for a parent
        self.scanner.scan()  # something the events did not report (a mkdir'ed dir in grace)
        return False

    def shutdown(self) -> None:
        """Stop claiming, stop generation between tokens, put in-flight jobs back in ready/,
        join every thread, free the model, release the workspace. Idempotent."""
        log.info("Shutting down server...")
        self.request_stop()
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._finisher is not None:  # after the workers: every job they ended is recorded first
            self._finishing.put(None)
            self._finisher.join()
            self._finisher = None
        if self.hooks is not None:
            self.hooks.stop()
            self.hooks = None
        if self.models is not None:
            self.models.close()
        self.registry.release()
        self.started = False
        log.info("Server stopped")

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- workers -------------------------------------------------------------------------

    def _work(self, index: int) -> None:
        try:
            self._work_loop(index)
        finally:
            if self.switch is not None:
                self.switch.leave()

    def _work_loop(self, index: int) -> None:
        name = threading.current_thread().name
        _name_os_thread(name)
        session = self._sessions[index]
        while not self._stop.is_set():
            try:
                session.clear_preempt()  # a later preempt() cuts the coming step short
                self._admit(index, session, name)
                active = session.active()
                self._loads.set_top(index, None)
                if not active and self.pool.active is None and self.switch is not None:  # models switch
                    self._loads.set_load(index, 0)
                    self.switch.park()
                    session = self._sessions[index]
                    continue
                if active and not self._stop.is_set():
                    mine = max(job_param(job.params, "priority") for job in active)
                    self._loads.set_top(index, mine)
                    if self._loads.outranked(mine):
                        # Another worker runs a job above all of this one's: pause, and lend it
                        # this worker's threads (see _share_cores), until it has ended.
                        self._loads.set_load(index, 0)
                        time.sleep(0.005)
                        continue
                    self._share_cores(index, session)
                    ended = session.step()
                    # A job's files (writes, fsyncs, renames: milliseconds) would hold up the
                    # jobs still running here: the Finisher records it while they go on.
                    later = bool(ended) and bool(session.active())
                    for job, outcome in ended:
                        if later and self._finishing.qsize() < FINISH_BACKLOG:
                            self._finishing.put((job, outcome))
                        else:
                            self._end(job, outcome)
                    if ended:
                        self.pool.favor(index, resting=not session.active())
            except Exception as err:  # a runner bug fails its jobs, never the worker
                log.error(f"runner error: {err!r}")
                for job in session.active():
                    session.drop(job)
                    self._end(job, Outcome(error_code="runner_error", error=f"runner failed: {err!r}"))
        self._loads.set_top(index, None)
        for job in session.active():
            session.drop(job)
            with self._stats_lock:
                self._running.pop(job.id, None)
            self.processor.requeue(job)
            self.pool.done(job.id)
        log.debug(f"{name} exiting")

    def _share_cores(self, index: int, session: Session) -> None:
        """Spread the workers' threads over the workers that have jobs, before each step.

        A worker whose queue share ran out (the tail of a batch, a lone job) would leave
        its core idle while another worker still decodes: that worker borrows the idle
        threads instead (capped at the core count), and hands them back at its next step
        once the idle worker has a job again. Measured on 2 cores: one context decodes
        1.6-1.9x faster with 2 threads than with 1 when the other core is free.
        """
        if not self._thread_budget:
            return
        share = self._loads.share(index, self._thread_budget)
        session.set_threads(max(session.base_threads, min(share, cpu_count())))

    def _admit(self, index: int, session: Session, name: str) -> None:
        """Claim jobs while the session has free slots (blocking only when it is idle).

        A busy worker leaves a job to any worker running fewer sequences: otherwise the
        first to wake would take a small batch whole while the others' cores sit idle.
        """
        while not self._stop.is_set():
            active = session.active()
            load = len(active)
            self._loads.set_load(index, load)
            above = None
            if session.free() <= 0:
                # Full: only a job above every running one, into the room kept for it.
                top = self.pool.top_priority()
                if top is None or session.reserve(top) <= 0:
                    return
                above = max((job_param(job.params, "priority") for job in active), default=None)
                # Said before the claim (a rename and fsyncs): the other workers pause now.
                self._loads.set_top(index, top)
                self._outranked(top)
            elif load and self._loads.lighter(index, load):
                return
            if not load and not len(self.pool):
                session.idle()
            job_id = self.pool.get(0.0 if load else 0.5, worker=index, above=above)
            if job_id is None:
                return
            try:
                job = self.processor.claim(job_id, name, self._stop, self.models.served[self.models.active].name)
            except (_HandBack, _Busy, _ParentWaits, NrvnaError, OSError) as err:
                _claim_later(self.pool, job_id, err)
                continue
            if job is None:
                self.pool.done(job_id)
                continue
            log.info(f"Processing job: {job_id}")
            self._loads.add(index)
            with self._stats_lock:
                self._running[job_id] = job
            try:
                session.start(job)
            except JobError as err:
                self._end(job, Outcome(error_code=err.code, error=str(err)))
            except Exception as err:
                self._end(job, Outcome(error_code="runner_error", error=f"runner failed: {err!r}"))

    def _finish_loop(self) -> None:
        """The Finisher thread: record the outcomes workers hand it (see _work_loop), in
        order, until shutdown sends None (after the workers have stopped)."""
        _name_os_thread("Finisher")
        while True:
            item = self._finishing.get()
            if item is None:
                return
            try:
                self._end(*item)
            except Exception as err:  # the job stays in processing/, held: the next recovery requeues it
                log.error(f"finisher error: {err!r}")

    def _outranked(self, priority: int) -> None:
        """A job of ``priority`` is queued or being claimed: cut short the steps of the workers
        whose jobs are all below it (they pause, or one of them takes it, at once)."""
        sessions = self._sessions
        for index in self._loads.below(priority):
            sessions[index].preempt()

    def _end(self, job: RunningJob, outcome: Outcome) -> None:
        with self._stats_lock:
            self._running.pop(job.id, None)
            if outcome.error_code is None:
                self._stats["jobs_done"] += 1
            else:
                self._stats["jobs_failed"] += 1
            self._stats["tokens_generated"] += outcome.generated_tokens
            self._recent.append((time.time(), outcome.generated_tokens))
        if self.processor.finish(job, outcome):
            self.pool.done(job.id)
            self.pool.released(job.id)  # its children, if any waited for it
            if self.hooks is not None:
                self.hooks.poke()
            if self.switch is not None:
                self.switch.wake.set()
            if outcome.error_code is None:
                if job_param(job.params, "embed"):
                    texts = len(job_param(job.params, "input") or [job.prompt])
                    log.info(f"Job completed: {job.id} ({texts} {'text' if texts == 1 else 'texts'} embedded, "
                             f"{outcome.prompt_tokens} tokens)")
                else:
                    log.info(f"Job completed: {job.id} ({outcome.generated_tokens} tokens, {outcome.finish_reason})")
            else:
                log.warning(f"Job failed: {job.id}: {outcome.error}")
        else:
            self.pool.retry_later(job.id, 2.0)

    def _fail_unloadable(self, job_ids: list[str], model: str, error: str) -> None:
        """Fail queued jobs (taken from the Pool) whose model this daemon gave up loading:
        claimed and ended as a worker ends a job, with load_failed."""
        for job_id in job_ids:
            try:
                job = self.processor.claim(job_id, "Models", self._stop, model)
            except (_HandBack, _Busy, _ParentWaits, NrvnaError, OSError) as err:  # as _admit
                _claim_later(self.pool, job_id, err)
                continue
            if job is None:
                self.pool.done(job_id)
                continue
            with self._stats_lock:
                self._running[job_id] = job
            self._end(job, Outcome(error_code="load_failed", error=error))


##############################################################################
# 13. Served API: OpenAI's Files, Batches and endpoints over a workspace, for any HTTP client
##############################################################################
# Owns `nrvna serve`: OpenAI's routes answered from the workspace's files over plain sockets (no
# framework). Invariant: it never loads a model or starts a daemon, and keeps nothing the files do
# not hold: killed at any instant and started again, it loses nothing. Threads: Api-IO, Api-N.


# ============================================================================
# 13.1 HTTP
# ============================================================================
# The bounds every request meets, a request's head, ApiError (OpenAI's error shape), ApiCall and
# ApiReply (what a handler gets and gives), API keys and the multipart reader. Invariant: nothing
# is read past a bound. Api-IO parses heads; an Api-N thread the rest.


API_HEAD_LIMIT = 32 << 10  # a request line and its headers, whole (else 431)
API_HEADERS_MAX = 100  # header lines in one head
API_BODY_LIMIT = 16 << 20  # a JSON body (an upload is bounded by FILE_BYTES_LIMIT instead); else 413
# A batch file may be up to 200 MB (OpenAI's limit); its multipart body may add this much framing.
FILE_BYTES_LIMIT = 200 * 1000 * 1000
MULTIPART_SLACK = 64 << 10
MULTIPART_PARTS = 16  # parts in one upload's body
MULTIPART_HEAD_LIMIT = 8 << 10  # one part's headers
MULTIPART_FIELD_LIMIT = 4 << 10  # one plain field's value (purpose)
# IDs as they appear in a URL: each is matched whole before it names anything on disk.
API_IDS: dict[str, Any] = {
    "file_id": re.compile(r"file-[a-z0-9]{24}"),
    "batch_id": re.compile(r"batch_[a-z0-9]{24}"),
}
# The error codes the served API answers with in OpenAI's error shape (``error.code``), beside a failed
# job's own code (FAILURE_CODES), which a synchronous request's error carries as it is. A test holds this
# table and section 13's literals equal.
API_ERROR_CODES: dict[str, str] = {
    "invalid_api_key": "no `Authorization: Bearer KEY`, or another key (401)",
    "not_found": "no such route, file or batch (404)",
    "body_too_large": "a JSON body over 16 MiB (413)",
    "file_too_large": "an upload over 200 MB (413)",
    "too_many_requests": "a batch file over 50,000 requests (400 at upload, or the batch's errors)",
    "invalid_request": "a batch that could not be read or queued (the batch's errors)",
    "invalid_file": "a batch's input file gone or unreadable (the batch's errors)",
    "invalid_url": "a batch line whose url is not the batch's endpoint (the batch's errors)",
    "invalid_json_line": "a batch line that is not JSON or not UTF-8 (the batch's errors)",
    "duplicate_custom_id": "two batch lines with one custom_id (the batch's errors)",
    "empty_file": "a batch file without a request (the batch's errors)",
    "batch_not_cancellable": "a cancel of a batch that has ended (400)",
    "batch_cancelled": "a batch line not run: its batch was cancelled (the error file)",
    "batch_expired": "a batch line not run before the batch's expires_at (the error file)",
    "model_not_found": "a model no live daemon serves (404, GET /v1/models/{model})",
    "model_not_served": "a synchronous request no live daemon serves within 10 s (503)",
}
_HTTP_REASONS = {200: "OK", 100: "Continue", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                 405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required",
                 410: "Gone", 413: "Content Too Large", 431: "Request Header Fields Too Large",
                 499: "Client Closed Request", 500: "Internal Server Error", 503: "Service Unavailable",
                 504: "Gateway Timeout"}
_PARAM = re.compile(r'([\w*-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;]*))')  # a header's name=value or name="value"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP method or header name


def _json_bytes(value: Any) -> bytes:
    import json

    return json.dumps(value, ensure_ascii=False).encode("utf-8")


class ApiError(Exception):
    """A refusal, answered as OpenAI answers one: ``{"error": {"message", "type", "param",
    "code"}}`` with HTTP ``status``.

    Threads: any (raised and answered by one request's thread); never shared."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ApiReply:
    """What a handler answers: ``payload`` (JSON), or ``stream`` (an iterator of bytes, sent as
    it comes: server-sent events), or ``content`` (a file's bytes, or the path of one).

    Threads: Api-N makes one and sends it; never shared."""

    __slots__ = ("status", "payload", "stream", "content", "content_type", "headers")

    def __init__(self, status: int = 200, payload: Any = None, stream: Optional[Iterable[bytes]] = None,
                 content: Any = None, content_type: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        self.status, self.payload, self.stream, self.content = status, payload, stream, content
        self.content_type = content_type or ("text/event-stream" if stream is not None else
                                             "application/octet-stream" if content is not None else
                                             "application/json")
        self.headers = dict(headers or {})


class _Head:
    """A request's line and headers, parsed from its first bytes by parse_head.

    Threads: Api-IO parses it, then hands it with its ApiCall to one Api-N; never shared."""

    __slots__ = ("method", "target", "version", "headers")

    def __init__(self, method: str, target: str, version: str, headers: dict[str, str]) -> None:
        self.method, self.target, self.version, self.headers = method, target, version, headers

    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        return "close" not in connection and (self.version == "HTTP/1.1" or "keep-alive" in connection)

    def body_length(self) -> int:
        """Content-Length; ApiError 411 for a body sent any other way, 400 for a bad length."""
        if "transfer-encoding" in self.headers:
            raise ApiError(411, "send the body with a Content-Length (a chunked body is not accepted)")
        text = self.headers.get("content-length")
        if text is None:
            return 0
        if not text.isdigit() or len(text) > 15:
            raise ApiError(400, f"Content-Length {text[:40]!r} is not a length")
        return int(text)

    def is_upload(self) -> bool:
        return self.headers.get("content-type", "").lower().startswith("multipart/form-data")


def parse_head(data: bytes) -> _Head:
    """A request's line and headers (``data``: up to the blank line, excluded); ApiError 400
    naming what is wrong (a duplicated Content-Length, a folded line, a bad name...)."""
    lines = data.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1].startswith("/") \
            or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise ApiError(400, f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    if len(lines) - 1 > API_HEADERS_MAX:
        raise ApiError(431, f"more than {API_HEADERS_MAX} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise ApiError(400, f"not a header line: {line[:80]!r}")
        name = name.lower()
        if name in headers and name in ("content-length", "transfer-encoding", "authorization", "content-type"):
            raise ApiError(400, f"header {name} is given twice")
        headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
    return _Head(parts[0], parts[1], parts[2], headers)


def api_key_matches(headers: Mapping[str, str], key: str) -> bool:
    """Whether ``Authorization: Bearer KEY`` carries ``key``, compared in constant time."""
    import hmac

    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                             key.encode("utf-8"))


def _json_body(body: bytes) -> dict[str, Any]:
    import json

    if not body:
        raise ApiError(400, "the request needs a JSON body")
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ApiError(400, f"the body is not JSON: {str(err)[:200]}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the body must be a JSON object")
    return value


class ApiCall:
    """What a handler gets: the workspace, the request (``method``, ``path``, ``params`` (the
    route's named parts), ``query``, ``headers``), its body (``json()``, or ``upload``: the
    path of a multipart body held on disk), ``gone()`` and ``files`` (ApiFiles).

    Threads: Api-IO makes it whole, then one Api-N alone uses it (the hand-off is a queue)."""

    __slots__ = ("workspace", "method", "path", "params", "query", "headers", "body", "upload", "files", "_sock")

    def __init__(self, workspace: str, head: _Head, path: str, query: dict[str, str], body: bytes,
                 upload: Optional[str], files: Any, sock: Any) -> None:
        self.workspace, self.method, self.path, self.query = workspace, head.method, path, query
        self.headers, self.body, self.upload, self.files, self._sock = head.headers, body, upload, files, sock
        self.params: dict[str, str] = {}

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; ApiError 400 when it is none."""
        return _json_body(self.body)

    def gone(self) -> bool:
        """Whether the client has closed its connection (poll it while waiting for a job)."""
        import select
        import socket

        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            if not poller.poll(0):
                return False
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


def _part_head(data: bytes) -> tuple[str, Optional[str]]:
    """A multipart part's form field name and file name, from its headers."""
    for line in data.decode("utf-8", "replace").split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() != "content-disposition":
            continue
        kind, _, rest = value.strip().partition(";")
        if kind.strip().lower() != "form-data":
            raise ApiError(400, "a multipart part is not form-data")
        found = {key.lower(): quoted.replace('\\"', '"') if quoted else bare.strip()
                 for key, quoted, bare in _PARAM.findall(rest)}
        if "name" not in found:
            raise ApiError(400, "a multipart part has no name")
        if "filename" not in found and "filename*" in found:  # RFC 5987: UTF-8''percent-encoded
            from urllib.parse import unquote

            found["filename"] = unquote(found["filename*"].partition("''")[2] or found["filename*"])
        return found["name"], found.get("filename")
    raise ApiError(400, "a multipart part has no Content-Disposition")


def _boundary(content_type: str) -> bytes:
    found = re.search(r';\s*boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', content_type, re.I)
    if found is None:
        raise ApiError(400, "Content-Type multipart/form-data needs a boundary of 1 to 70 characters")
    return (found.group(1) or found.group(2)).encode("latin-1")


def read_multipart(fd: int, size: int, content_type: str) -> dict[str, tuple[Optional[str], int, int]]:
    """The parts of a multipart/form-data body held in ``fd`` (``size`` bytes), found without
    reading the body into memory: name -> (file name or None, first byte, end). ApiError 400
    for a body that is not one (no closing boundary, too many parts, a name given twice)."""
    boundary = b"--" + _boundary(content_type)
    starts, offset, tail = [], 0, b""
    while offset < size:
        chunk = os.pread(fd, min(1 << 20, size - offset), offset)
        if not chunk:
            break
        window, base = tail + chunk, offset - len(tail)
        at = window.find(boundary)
        while at >= 0:
            # a delimiter: at the start of a line, followed by CRLF or (the last) "--"; one seen
            # too near the window's end is seen again in the next (the tail holds it whole)
            after = window[at + len(boundary):at + len(boundary) + 2]
            if (base + at == 0 or window[at - 2:at] == b"\r\n") and (not starts or base + at > starts[-1]) \
                    and after in (b"\r\n", b"--"):
                starts.append(base + at)
                if len(starts) > MULTIPART_PARTS + 1:
                    raise ApiError(400, f"the upload has more than {MULTIPART_PARTS} parts")
            at = window.find(boundary, at + 1)
        offset += len(chunk)
        tail = window[-(len(boundary) + 4):]
    parts: dict[str, tuple[Optional[str], int, int]] = {}
    for first, after in zip(starts, starts[1:]):
        begin = first + len(boundary)
        head = os.pread(fd, min(MULTIPART_HEAD_LIMIT + 4, after - begin), begin)
        ends = head.find(b"\r\n\r\n")
        if not head.startswith(b"\r\n") or ends < 0:
            raise ApiError(400, "a multipart part's headers are missing or over "
                                f"{MULTIPART_HEAD_LIMIT} bytes")
        name, filename = _part_head(head[2:ends])
        if name in parts:
            raise ApiError(400, f"multipart field {name!r} is given twice", param=name)
        parts[name] = (filename, begin + ends + 4, after - 2)
    if not starts or os.pread(fd, 2, starts[-1] + len(boundary)) != b"--":
        raise ApiError(400, "the multipart body ends before its closing boundary")
    return parts


def multipart_field(fd: int, part: tuple[Optional[str], int, int], name: str) -> str:
    """A plain field's value (at most MULTIPART_FIELD_LIMIT bytes of UTF-8)."""
    _, first, end = part
    if end - first > MULTIPART_FIELD_LIMIT:
        raise ApiError(400, f"field {name!r} is over {MULTIPART_FIELD_LIMIT} bytes", param=name)
    try:
        return os.pread(fd, end - first, first).decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, f"field {name!r} is not UTF-8", param=name) from None


def file_chunks(fd: int, first: int, end: int) -> Iterator[bytes]:
    """Bytes ``first`` to ``end`` of ``fd``, a MiB at a time."""
    while first < end:
        chunk = os.pread(fd, min(1 << 20, end - first), first)
        if not chunk:
            raise ApiError(400, "the upload is shorter than it said")
        first += len(chunk)
        yield chunk


# ============================================================================
# 13.2 Files
# ============================================================================
# ApiFiles: OpenAI's files, kept in the workspace as api/files/<file_id>/{content,file.json}, each
# published whole by one rename of a finished folder. Invariant: a listed file is whole and
# durable; a deletion removes only what nrvna wrote. Any Api-N thread (each file its own folder).


API_DIR = "api"
API_FILES = os.path.join(API_DIR, "files")  # api/files/<file_id>/: one published file
API_TEMP = os.path.join(API_DIR, "tmp")  # uploads being received, files being written or removed
FILE_CONTENT = "content"
FILE_RECORD = "file.json"
FILE_RECORD_LIMIT = 64 << 10
FILE_PURPOSES = ("batch",)  # what an upload may be for (batch_output: the batches' own files)
FILE_NAME_LIMIT = 1024  # characters of a file's name, as given (it names nothing on disk)
BATCH_FILE_LINES = 50_000  # requests in one batch file (OpenAI's limit)
STALE_API_TEMP_SECONDS = 3600  # a temporary entry of a process that died is removed after this
_API_TEMP_NAME = re.compile(r"(upload|new|gone)-([0-9]+)-[0-9a-z]+(?:-(file-[a-z0-9]{24}))?")


def api_token(length: int = 24) -> str:
    """``length`` random characters of [a-z0-9] (an ID's tail)."""
    import secrets

    return "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(length))


def api_temp_name(kind: str, tail: str = "") -> str:
    """A name in api/tmp/ for this process: ``kind-<pid>-<token>[-tail]``."""
    return f"{kind}-{os.getpid()}-{api_token(12)}" + (f"-{tail}" if tail else "")


def _file_object(record: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A file.json read back as OpenAI's file object; None when it is not one nrvna wrote."""
    shapes = {"id": str, "bytes": int, "created_at": int, "filename": str, "purpose": str}
    if any(type(record.get(key)) is not kind for key, kind in shapes.items()):
        return None
    return {"id": record["id"], "object": "file", "bytes": record["bytes"], "created_at": record["created_at"],
            "filename": record["filename"], "purpose": record["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


class ApiFiles:
    """The files of a workspace's served API (OpenAI's file objects). create and publish write a
    folder under api/tmp/, then rename it to api/files/<file_id>; delete renames it back aside
    and removes only content, file.json and their temporary names.

    Threads: any Api-N thread; each call works on one file's folder, published or removed by a
    rename."""

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self.root = os.path.join(workspace, API_FILES)
        self.temp = os.path.join(workspace, API_TEMP)

    def _ready(self) -> None:
        for path in (os.path.join(self.workspace, API_DIR), self.root, self.temp):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, DIR_MODE)

    def create(self, source: Iterable[bytes], size: int, filename: str, purpose: str) -> dict[str, Any]:
        """Write an upload (``size`` bytes from ``source``) as a new file; its OpenAI object.
        ApiError for a purpose other than FILE_PURPOSES', a file over FILE_BYTES_LIMIT or, for a
        batch, over BATCH_FILE_LINES lines."""
        if purpose not in FILE_PURPOSES:
            raise ApiError(400, f"purpose {purpose[:40]!r} is not one of: {', '.join(FILE_PURPOSES)}",
                           param="purpose")
        if size > FILE_BYTES_LIMIT:
            raise ApiError(413, f"the file is {size:,} bytes; a batch file may be up to {FILE_BYTES_LIMIT:,}",
                           param="file", code="file_too_large")
        return self._write("file-" + api_token(), source, filename, purpose, lines=BATCH_FILE_LINES)

    def publish(self, file_id: str, chunks: Iterable[bytes], filename: str, purpose: str) -> dict[str, Any]:
        """Write ``chunks`` as file ``file_id`` (an ID its caller derives: a batch's output),
        whole or not at all; a file already published under that ID is returned as it is."""
        found = self._find(file_id)
        return found if found is not None else self._write(file_id, chunks, filename, purpose, lines=0)

    def _write(self, file_id: str, chunks: Iterable[bytes], filename: str, purpose: str,
               lines: int) -> dict[str, Any]:
        self._ready()
        folder = os.path.join(self.temp, api_temp_name("new", file_id))
        os.mkdir(folder, DIR_MODE)
        try:
            size = self._fill(folder, chunks, lines)
            record = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                      "filename": str(filename)[:FILE_NAME_LIMIT], "purpose": purpose}
            fd = open_dir(folder)
            try:
                write_file(fd, FILE_RECORD, _json_bytes(record))
                os.fsync(fd)
            finally:
                os.close(fd)
            move(folder, os.path.join(self.root, file_id))
        except FileExistsError:  # published meanwhile by another thread or process: that one stands
            self._remove(folder)
            found = self._find(file_id)
            if found is None:
                raise
            return found
        except BaseException:
            self._remove(folder)
            raise
        fsync_dir(self.root)
        return _file_object(record) or {}

    def _fill(self, folder: str, chunks: Iterable[bytes], lines: int) -> int:
        """Write ``chunks`` to folder/content, fsynced; its size. ApiError past the bounds."""
        fd = os.open(os.path.join(folder, FILE_CONTENT), os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                     FILE_MODE)
        size = newlines = 0
        last = b"\n"
        try:
            for chunk in chunks:
                size += len(chunk)
                if size > FILE_BYTES_LIMIT:
                    raise ApiError(413, f"the file is over {FILE_BYTES_LIMIT:,} bytes", param="file",
                                   code="file_too_large")
                newlines += chunk.count(b"\n")
                if chunk:
                    last = chunk[-1:]
                if lines and newlines + (last != b"\n") > lines:
                    raise ApiError(400, f"a batch file may hold up to {lines:,} requests (lines)", param="file",
                                   code="too_many_requests")
                write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def _remove(self, folder: str) -> None:
        """Remove a file's folder: only the names nrvna writes there, then the folder (left in
        place, with a warning, when something else is in it)."""
        for name in (FILE_CONTENT, FILE_RECORD, f".{FILE_RECORD}.tmp"):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(os.path.join(folder, name))
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning(f"{folder} holds files nrvna did not write; left there ({_os_error(err)})")

    def _find(self, file_id: str) -> Optional[dict[str, Any]]:
        if not isinstance(file_id, str) or API_IDS["file_id"].fullmatch(file_id) is None:
            return None
        folder = os.path.join(self.root, file_id)
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(folder).st_mode):  # a link put there is never followed
                found = _file_object(read_record(os.path.join(folder, FILE_RECORD), FILE_RECORD_LIMIT))
                return found if found is not None and found["id"] == file_id else None
        return None

    def new_upload(self) -> tuple[str, int]:
        """A new file in api/tmp/ for an upload's body as it arrives: (its path, a descriptor
        open for writing); the reader removes it once answered."""
        self._ready()
        path = os.path.join(self.temp, api_temp_name("upload"))
        return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)

    def get(self, file_id: str) -> dict[str, Any]:
        """File ``file_id``'s OpenAI object; ApiError 404 when there is none."""
        found = self._find(file_id)
        if found is None:
            raise ApiError(404, f"No such File object: {str(file_id)[:80]}", param="file_id")
        return found

    def content_path(self, file_id: str) -> Path:
        """The path of file ``file_id``'s content (ApiError 404 when there is none): open it
        without following a link (O_NOFOLLOW) and check that it is a regular file."""
        from pathlib import Path

        self.get(file_id)
        return Path(self.root, file_id, FILE_CONTENT)

    def list(self, purpose: Optional[str] = None, after: Optional[str] = None, limit: int = 10000,
             order: str = "desc") -> list[dict[str, Any]]:
        """Up to ``limit`` files (of ``purpose``), newest first (``order="asc"``: oldest), those
        after file ``after`` in that order only."""
        try:
            names = [name for name in os.listdir(self.root) if API_IDS["file_id"].fullmatch(name)]
        except FileNotFoundError:
            names = []
        found = [obj for obj in map(self._find, names) if obj is not None
                 and (purpose is None or obj["purpose"] == purpose)]
        found.sort(key=lambda obj: (obj["created_at"], obj["id"]), reverse=order != "asc")
        if after is not None:
            ids = [obj["id"] for obj in found]
            found = found[ids.index(after) + 1:] if after in ids else []
        return found[:limit]

    def delete(self, file_id: str) -> dict[str, Any]:
        """Remove file ``file_id``: ``{"id", "object": "file", "deleted": True}``; ApiError 404
        when there is none."""
        self.get(file_id)
        self._ready()
        aside = os.path.join(self.temp, api_temp_name("gone", file_id))
        try:
            move(os.path.join(self.root, file_id), aside)
        except FileNotFoundError:  # deleted meanwhile
            raise ApiError(404, f"No such File object: {file_id}", param="file_id") from None
        fsync_dir(self.root)
        self._remove(aside)
        return {"id": file_id, "object": "file", "deleted": True}

    def sweep(self) -> None:
        """Remove api/tmp/'s entries left by processes that died (nrvna's names only, after
        STALE_API_TEMP_SECONDS): an upload's body, a file half written or half removed."""
        try:
            names = os.listdir(self.temp)
        except OSError:
            return
        for name in names:
            match = _API_TEMP_NAME.fullmatch(name)
            path = os.path.join(self.temp, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if match is None or _process_exists(int(match.group(2))) or \
                    time.time() - info.st_mtime < STALE_API_TEMP_SECONDS:
                continue
            if match.group(1) == "upload" and stat.S_ISREG(info.st_mode):
                _unlink_quietly(path, None)
            elif stat.S_ISDIR(info.st_mode):
                self._remove(path)


# ============================================================================
# 13.3 Batches
# ============================================================================
# OpenAI's batches: api/batches/<id>.json (the record: the steps taken), the input linked beside it, the
# lines as jobs tagged <id>. Invariant: a record is rewritten whole under a flock on api/batches/, and each
# step is redone the same after a crash (the tag's resume by custom_id; files under IDs derived from the
# batch's). Any Api-N thread; the Batches thread (BatchLifecycle) while it holds api/batches/lifecycle.lock.


BATCHES = os.path.join(API_DIR, "batches")
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
BATCH_WINDOWS = {"24h": 24 * 3600}  # completion_window: OpenAI offers 24h alone
BATCH_METADATA = (16, 64, 512)  # OpenAI's bounds on metadata: pairs, a key's characters, a value's
BATCH_LIST_LIMIT = (20, 100)  # GET /v1/batches: limit's default and most (OpenAI's)
BATCH_RECORD_BYTES = 1 << 20
LIFECYCLE_LOCK = "lifecycle.lock"
BATCH_TICK_SECONDS = 0.5
# A batch's lines are read again only after this many times the last read took: a 50,000-line batch's
# read (1.5 s of CPU here) every tick kept the Batches thread busy a whole core beside the daemon.
BATCH_LOOK_SPACING = 10
# The steps a record holds: the status is the first of these it has (failed... in_progress), else
# validating. A step, once recorded, is never changed.
BATCH_STEPS = (("failed_at", "failed"), ("cancelled_at", "cancelled"), ("expired_at", "expired"),
               ("completed_at", "completed"), ("finalizing_at", "finalizing"), ("cancelling_at", "cancelling"),
               ("in_progress_at", "in_progress"))
BATCH_ENDED = ("failed", "cancelled", "expired", "completed")
# The error file's line for a request a cancel or an expiry stopped: OpenAI's code and words.
BATCH_STOPPED = {"cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
                 "expired": ("batch_expired", "This request could not be executed before the completion "
                                              "window expired.")}
# A record without these (or naming another ID) is no batch.
BATCH_REQUIRED = ("id", "input_file_id", "endpoint", "completion_window", "created_at", "expires_at")
# A batch file's errors (errors.data): nrvna's refusal of a line, as OpenAI's code and param.
BATCH_LINE_ERRORS = (("duplicate custom_id", "duplicate_custom_id", "custom_id"),
                     ("invalid JSON", "invalid_json_line", None), ("not valid UTF-8", "invalid_json_line", None),
                     ("url ", "invalid_url", "url"), ("has no prompts", "empty_file", None))


def _is_stamp(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 40


def _is_metadata(value: Any) -> bool:
    pairs, key_chars, value_chars = BATCH_METADATA
    return type(value) is dict and len(value) <= pairs and all(
        type(k) is str and len(k) <= key_chars and type(v) is str and len(v) <= value_chars for k, v in value.items())


# What each field of a batch record must be, read back: a field that is not so is read as absent.
BATCH_RECORD_FIELDS: dict[str, Callable[[Any], bool]] = {
    "id": lambda value: type(value) is str and API_IDS["batch_id"].fullmatch(value) is not None,
    "input_file_id": _is_text, "endpoint": lambda value: value in BATCH_ENDPOINTS,
    "completion_window": lambda value: value in BATCH_WINDOWS, "created": _is_time,
    "metadata": lambda value: value is None or _is_metadata(value),
    **dict.fromkeys(("created_at", "expires_at", "total", *(step for step, _ in BATCH_STEPS)), _is_stamp),
    "errors": lambda value: type(value) is list and all(type(entry) is dict for entry in value),
    **dict.fromkeys(("output_file_id", "error_file_id", "model"), lambda value: value is None or _is_text(value)),
    "request_counts": lambda value: type(value) is dict and all(
        _is_count(value.get(name)) for name in ("total", "completed", "failed")),
    "usage": lambda value: value is None or type(value) is dict,
}


def batch_status(record: Mapping[str, Any]) -> str:
    """A batch's status from the steps its record holds (BATCH_STEPS)."""
    for step, status in BATCH_STEPS:
        if record.get(step) is not None:
            return status
    return "validating"


def batch_file_id(batch_id: str, role: str) -> str:
    """The ID of a batch's ``output`` or ``error`` file: derived from the batch's, so a finalize
    redone after a crash publishes the same file (ApiFiles.publish returns it as it is)."""
    import hashlib

    return "file-" + hashlib.sha256(f"{batch_id}/{role}".encode()).hexdigest()[:24]


def check_batch_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """POST /v1/batches' body checked (ApiError 400 naming the field): its input_file_id,
    endpoint, completion_window and metadata."""
    for key in body:
        if key not in ("input_file_id", "endpoint", "completion_window", "metadata"):
            raise ApiError(400, f"unknown field {key!r} (a batch takes input_file_id, endpoint, completion_window, "
                           "metadata)", param=key)
    file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if not isinstance(file_id, str):
        raise ApiError(400, "input_file_id is required: the ID of a file uploaded with purpose batch",
                       param="input_file_id")
    if endpoint not in BATCH_ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    if window not in BATCH_WINDOWS:
        raise ApiError(400, f"completion_window must be {' or '.join(map(repr, BATCH_WINDOWS))}",
                       param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not _is_metadata(metadata):
        pairs, key_chars, value_chars = BATCH_METADATA
        raise ApiError(400, f"metadata must be at most {pairs} pairs of strings, keys up to {key_chars} characters "
                       f"and values up to {value_chars}", param="metadata")
    return {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window, "metadata": metadata}


def batch_errors(data: bytes, endpoint: str) -> list[dict[str, Any]]:
    """A batch file's errors as OpenAI's errors.data ({code, message, line, param}; [] when it
    passes): nrvna's batch checks (parse_batch: the first bad line, a duplicate custom_id), a line
    whose url is not the batch's ``endpoint``, more than BATCH_FILE_LINES requests."""
    try:
        entries = parse_batch(data, jsonl=True)
    except InvalidInput as err:
        return [_batch_line_error(str(err))]
    for entry in entries:
        url = entry.params.get("endpoint")
        if url != endpoint:
            what = f"url {url!r}" if url else "not an OpenAI Batch request line: it has no url"
            return [{"code": "invalid_url", "line": entry.line, "param": "url",
                     "message": f"{what}; every line of this batch must be a request to {endpoint}"}]
    if len(entries) > BATCH_FILE_LINES:
        return [{"code": "too_many_requests", "line": None, "param": None,
                 "message": f"{len(entries):,} requests; a batch holds at most {BATCH_FILE_LINES:,}"}]
    return []


def _batch_line_error(message: str) -> dict[str, Any]:
    """parse_batch's refusal (``line N: why``) as one of errors.data."""
    match = re.match(r"line (\d+): ", message)
    line, why = (int(match.group(1)), message[match.end():]) if match else (None, message)
    for said, code, param in BATCH_LINE_ERRORS:
        if said in why:
            return {"code": code, "line": line, "param": param, "message": why}
    return {"code": "invalid_request", "line": line, "param": None, "message": why}


class ApiBatches:
    """The batches of a workspace as OpenAI's batch objects: create (the record and its input
    durable before it returns), get, list, cancel (a step in the record), and what the lifecycle
    reads and records. Threads: any; a record's read-modify-write holds the records' flock."""

    def __init__(self, workspace: str, files: ApiFiles) -> None:
        self.workspace, self.files = workspace, files
        self.folder = os.path.join(workspace, BATCHES)

    @contextlib.contextmanager
    def locked(self) -> Iterator[int]:
        """api/batches/ open and flock'ed (made first if need be): its descriptor."""
        self._make_folder()
        fd = open_dir(self.folder)
        try:
            _flock(fd, wait=True)
            yield fd
        finally:
            os.close(fd)

    def _make_folder(self) -> None:
        if os.path.isdir(self.folder):
            return
        ensure_workspace(self.workspace)
        for path in (os.path.dirname(self.folder), self.folder):
            try:
                os.mkdir(path, DIR_MODE)
                fsync_dir(os.path.dirname(path))
            except FileExistsError:
                pass

    def ids(self) -> list[str]:
        """The IDs of the batches whose record is in api/batches/."""
        try:
            names = os.listdir(self.folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(name[:-5] for name in names
                      if name.endswith(".json") and API_IDS["batch_id"].fullmatch(name[:-5]))

    def record(self, batch_id: str) -> Optional[dict[str, Any]]:
        """Batch ``batch_id``'s record as BATCH_RECORD_FIELDS reads it, or None: no such batch,
        or a record that is not nrvna's (read_record's checks: no link, FIFO, oversize file)."""
        if not API_IDS["batch_id"].fullmatch(batch_id):
            return None
        record = read_record(os.path.join(self.folder, f"{batch_id}.json"), BATCH_RECORD_BYTES)
        record = {key: value for key, value in record.items()
                  if key in BATCH_RECORD_FIELDS and shallow(value) and BATCH_RECORD_FIELDS[key](value)}
        if any(key not in record for key in BATCH_REQUIRED) or record["id"] != batch_id:
            return None
        return record

    def _write(self, dir_fd: int, record: Mapping[str, Any]) -> None:
        import json

        write_file(dir_fd, f"{record['id']}.json", json.dumps(record, ensure_ascii=False, indent=1).encode())
        os.fsync(dir_fd)

    def update(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        """Record ``fields`` in the batch's record (a step already recorded is kept as it is),
        rewritten whole and durable; the record as it is now. ApiError 404: no such batch."""
        with self.locked() as dir_fd:
            record = self.record(batch_id)
            if record is None:
                raise ApiError(404, f"no batch {batch_id}", code="not_found")
            for key, value in fields.items():
                if key not in dict(BATCH_STEPS) or record.get(key) is None:
                    record[key] = value
            self._write(dir_fd, record)
        return record

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/batches: a new batch, validating; its record and input durable on return."""
        request = check_batch_request(body)
        found = self.files.get(request["input_file_id"])  # ApiError 404
        if found.get("purpose") != "batch":
            raise ApiError(400, f"file {request['input_file_id']} was uploaded with purpose {found.get('purpose')!r}; "
                           "a batch's input needs purpose batch", param="input_file_id")
        now = time.time()
        record = {"id": "batch_" + api_token(), **request, "created": now, "created_at": int(now),
                  "expires_at": int(now) + BATCH_WINDOWS[request["completion_window"]]}
        with self.locked() as dir_fd:
            self._keep_input(dir_fd, record["id"], request["input_file_id"])
            self._write(dir_fd, record)
        return self.batch_object(record)

    def _keep_input(self, dir_fd: int, batch_id: str, file_id: str) -> None:
        """The input as the batch's own (<id>.jsonl): a hard link (a copy where links fail), so a
        DELETE of the file later changes nothing; durable once the caller fsyncs the folder."""
        source = os.fspath(self.files.content_path(file_id))
        try:
            os.link(source, f"{batch_id}.jsonl", dst_dir_fd=dir_fd, follow_symlinks=False)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            with open(source, "rb") as handle:
                write_file(dir_fd, f"{batch_id}.jsonl", handle.read(FILE_BYTES_LIMIT + 1)[:FILE_BYTES_LIMIT])

    def input(self, batch_id: str) -> bytes:
        """The batch's input file (JobError: a link, a FIFO, over FILE_BYTES_LIMIT; OSError: gone)."""
        fd = open_dir(self.folder)
        try:
            return read_file(fd, f"{batch_id}.jsonl", FILE_BYTES_LIMIT)
        finally:
            os.close(fd)

    def get(self, batch_id: str) -> dict[str, Any]:
        """GET /v1/batches/{id}: the batch object (ApiError 404)."""
        record = self.record(batch_id)
        if record is None:
            raise ApiError(404, f"no batch {batch_id}", code="not_found")
        return self.batch_object(record)

    def list(self, after: Optional[str] = None, limit: Optional[str] = None) -> dict[str, Any]:
        """GET /v1/batches: OpenAI's list object, newest first, ``limit`` (1 to 100) after batch ``after``."""
        default, most = BATCH_LIST_LIMIT
        count = default if limit is None else int(limit) if str(limit).isdigit() else 0
        if not 1 <= count <= most:
            raise ApiError(400, f"limit must be an integer from 1 to {most}", param="limit")
        records = [r for r in map(self.record, self.ids()) if r is not None]
        records.sort(key=lambda r: (r.get("created", r["created_at"]), r["id"]), reverse=True)
        start = 0
        if after is not None:
            start = next((i + 1 for i, r in enumerate(records) if r["id"] == after), -1)
            if start < 0:
                raise ApiError(400, f"after names no batch: {after!r}", param="after")
        page = records[start:start + count]
        return {"object": "list", "data": [self.batch_object(r) for r in page],
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
                "has_more": start + count < len(records)}

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """POST /v1/batches/{id}/cancel: cancelling (the lifecycle then cancels its jobs), or as it
        is when cancelling or cancelled already; ApiError 400 for a batch past cancelling."""
        with self.locked() as dir_fd:
            record = self.record(batch_id)
            if record is None:
                raise ApiError(404, f"no batch {batch_id}", code="not_found")
            status = batch_status(record)
            if status in ("validating", "in_progress"):
                record["cancelling_at"] = int(time.time())
                self._write(dir_fd, record)
            elif status not in ("cancelling", "cancelled"):
                raise ApiError(400, f"batch {batch_id} is {status}: only a validating or in_progress batch can be "
                               "cancelled", code="batch_not_cancellable")
        return self.batch_object(record)

    def lines(self, batch_id: str) -> tuple[list[str], dict[str, Status]]:
        """The batch's jobs, one per custom_id (the latest that exists), in submission order, and
        their states."""
        members = tag_members(self.workspace, batch_id)
        states = bulk_states(self.workspace, [job_id for job_id, _ in members])
        latest: dict[Optional[str], str] = {}
        for job_id, cid in members:
            if states[job_id] is not Status.Missing:
                latest.pop(cid, None)  # its place is the latest's
                latest[cid] = job_id
        return list(latest.values()), states

    def batch_object(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """OpenAI's batch object for ``record``: its request_counts recorded once it ended,
        counted from its tag's jobs before."""
        status = batch_status(record)
        counts = record.get("request_counts")
        if counts is None or status not in BATCH_ENDED:
            counts = self._counts(record)
        errors = record.get("errors")
        return {"id": record["id"], "object": "batch", "endpoint": record["endpoint"],
                "errors": {"object": "list", "data": errors} if errors else None,
                "input_file_id": record["input_file_id"], "completion_window": record["completion_window"],
                "status": status, "output_file_id": record.get("output_file_id"),
                "error_file_id": record.get("error_file_id"), "created_at": record["created_at"],
                "in_progress_at": record.get("in_progress_at"), "expires_at": record["expires_at"],
                **{step: record.get(step) for step in ("finalizing_at", "completed_at", "failed_at", "expired_at",
                                                       "cancelling_at", "cancelled_at")},
                "request_counts": counts, "metadata": record.get("metadata"), "model": record.get("model"),
                "usage": record.get("usage")}


    def _counts(self, record: Mapping[str, Any]) -> dict[str, int]:
        """request_counts of a batch not ended, from its tag's jobs; none done yet where its tag's
        index cannot be read (a FIFO, a foreign file: the Batches thread names it), so that one
        batch's damaged index never fails GET /v1/batches for every other batch."""
        counts = {"total": record.get("total", 0), "completed": 0, "failed": 0}
        if record.get("in_progress_at") is None:
            return counts
        try:
            jobs, states = self.lines(record["id"])
        except (NrvnaError, OSError):
            return counts
        ended = [states[job_id] for job_id in jobs if states[job_id].finished]
        done = sum(state is Status.Done for state in ended)
        return dict(counts, completed=done, failed=len(ended) - done)


class BatchLifecycle:
    """The Batches thread: takes each batch a step on, every BATCH_TICK_SECONDS, while it holds
    api/batches/lifecycle.lock (one process of a workspace at a time: a second server's thread
    waits for the lock, and takes over when the first dies). Every step is redone the same after
    a crash at any instant: validating submits the file under the batch's tag (a resubmit queues
    only the custom_ids the tag lacks); a cancel or an expiry cancels the tag's unfinished jobs;
    the end publishes the output and error files under IDs derived from the batch's, then records
    the end in one write. Threads: its own; ApiServer's start and stop."""

    def __init__(self, batches: ApiBatches, tick: float = BATCH_TICK_SECONDS) -> None:
        self.batches, self.tick = batches, tick
        self.ended: set[str] = set()  # batches seen ended: never read again
        self.next_look: dict[str, float] = {}  # batch -> when its lines are read again (monotonic)
        self._halt = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock_fd = -1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="Batches", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (after its step in hand) and let the lock go once it has ended: never
        while a step runs, which another server's thread would then take too."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout)  # still in a step past it (a long submit): it lets go when the step ends

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                if self._holds_lock():
                    self.step()
            except Exception as err:  # a fault of the workspace: said, and tried again next tick
                log.limited("batches", f"batches: {type(err).__name__}: {err}")
            self._halt.wait(self.tick)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the thread's own: let go only once no step runs
            self._lock_fd = -1

    def _holds_lock(self) -> bool:
        if self._lock_fd < 0:
            with self.batches.locked():
                pass  # the folder exists
            fd = os.open(os.path.join(self.batches.folder, LIFECYCLE_LOCK), os.O_RDWR | os.O_CREAT | O_NOFOLLOW
                         | O_CLOEXEC, FILE_MODE)
            self._lock_fd = _locked(fd) or -1
        return self._lock_fd >= 0

    def step(self) -> None:
        """Take every batch not ended a step on (each on its own: one's fault spares the others)."""
        for batch_id in self.batches.ids():
            if batch_id in self.ended or self._halt.is_set():
                continue
            try:
                self.advance(batch_id)
            except (NrvnaError, OSError, ApiError) as err:
                log.limited(f"batch {batch_id}", f"batch {batch_id}: {err}", "warning")

    def advance(self, batch_id: str) -> None:
        """One step of one batch: validate and submit, cancel, or end it."""
        record = self.batches.record(batch_id)
        if record is None or batch_status(record) in BATCH_ENDED:
            if record is not None:
                self.ended.add(batch_id)
                self.next_look.pop(batch_id, None)
            return
        now = time.time()
        ending = ("cancelled" if record.get("cancelling_at") is not None else
                  "expired" if now >= record["expires_at"] else None)
        if ending is None and record.get("in_progress_at") is None:
            self._submit(record)
            return
        if ending is None and time.monotonic() < self.next_look.get(batch_id, 0.0):
            return  # a large batch's lines were read lately (a cancel or an expiry is not kept waiting)
        began = time.monotonic()
        jobs, states = self.batches.lines(batch_id)
        self.next_look[batch_id] = time.monotonic() + BATCH_LOOK_SPACING * (time.monotonic() - began)
        if any(states[job_id] in (Status.Queued, Status.Running) for job_id in jobs):
            if ending is None:
                return
            cancel_jobs(self.batches.workspace, tag=batch_id, timeout=0.1)
            jobs, states = self.batches.lines(batch_id)
            if any(states[job_id] in (Status.Queued, Status.Running) for job_id in jobs):
                return  # a running job stops between tokens: look again next tick
        if ending is None and record.get("finalizing_at") is None:
            record = self.batches.update(batch_id, finalizing_at=int(now))
        self._end(record, ending or "completed", jobs, states)

    def _submit(self, record: dict[str, Any]) -> None:
        """validating -> failed (errors) or in_progress (every line a job of the batch's tag)."""
        batch_id, now = record["id"], int(time.time())
        try:
            data = self.batches.input(batch_id)
        except (OSError, JobError) as err:
            why = _os_error(err) if isinstance(err, OSError) else str(err)
            self.batches.update(batch_id, failed_at=now, errors=[
                {"code": "invalid_file", "line": None, "param": "input_file_id",
                 "message": f"the batch's input cannot be read: {why}"}])
            return
        errors = batch_errors(data, record["endpoint"])
        if not errors:
            try:
                ids = Work(self.batches.workspace).submit_file(data, tag=batch_id, jsonl=True)
            except InvalidInput as err:  # a check past parse_batch's (a parent, a model under strict models)
                errors = [_batch_line_error(str(err))]
        if errors:
            self.batches.update(batch_id, failed_at=now, errors=errors)
        else:
            self.batches.update(batch_id, in_progress_at=now, total=len(ids))

    def _end(self, record: dict[str, Any], ending: str, jobs: list[str], states: dict[str, Status]) -> None:
        """Publish the output and error files and record the end, in one write."""
        batch_id = record["id"]
        since = None if ending == "completed" else record.get("cancelling_at") or record["expires_at"]
        done = [job_id for job_id in jobs if states[job_id] is Status.Done]
        failed = [job_id for job_id in jobs if states[job_id] is Status.Failed]
        unsent = self._unsent(record, jobs) if record.get("in_progress_at") is None else []
        files = self.batches.files
        output = error = None
        if done:
            output = files.publish(batch_file_id(batch_id, "output"), self._lines(done, None, ending),
                                   f"{batch_id}_output.jsonl", "batch_output")["id"]
        if failed or unsent:
            lines = itertools.chain(self._lines(failed, since, ending), unsent)
            error = files.publish(batch_file_id(batch_id, "error"), lines, f"{batch_id}_error.jsonl",
                                  "batch_output")["id"]
        total = max(record.get("total", 0), len(done) + len(failed) + len(unsent))
        usage, model = self._usage(done)
        self.batches.update(batch_id, output_file_id=output, error_file_id=error, usage=usage, model=model,
                            request_counts={"total": total, "completed": len(done),
                                            "failed": len(failed) + len(unsent)},
                            **{f"{ending}_at": int(time.time())})
        self.ended.add(batch_id)
        self.next_look.pop(batch_id, None)

    def _lines(self, jobs: list[str], since: Optional[int], ending: str) -> Iterator[bytes]:
        """The jobs' lines as ``nrvna export --format openai`` writes them; a job the batch's
        cancel or expiry stopped (cancelled at ``since`` or later) as OpenAI's batch_cancelled or
        batch_expired line."""
        import json

        flow, line = Flow(self.batches.workspace), EXPORT_FORMATS["openai"].line
        for job_id in jobs:
            job = flow.get(job_id)
            if job is None:
                continue  # removed since (clean)
            meta = job.meta
            if since is not None and meta.get("code") == "cancelled" and meta.get("finished", 0) >= since - 1:
                code, message = BATCH_STOPPED[ending]
                yield (json.dumps({"id": f"batch_req_{job.id}", "custom_id": job_param(job.params or {}, "custom_id"),
                                   "response": None, "error": {"code": code, "message": message}},
                                  ensure_ascii=False) + "\n").encode()
            else:
                yield line(job).encode()

    def _unsent(self, record: dict[str, Any], jobs: list[str]) -> list[bytes]:
        """The error lines of the input's lines that never became jobs (cancelled or expired
        while validating)."""
        import json

        try:
            entries = parse_batch(self.batches.input(record["id"]), jsonl=True)
        except (NrvnaError, OSError):
            return []  # an input that cannot be read or parsed has no lines to name
        members = tag_members(self.batches.workspace, record["id"])  # a killed submit's unpublished ones are Missing
        states = bulk_states(self.batches.workspace, [job_id for job_id, _ in members])
        have = {cid for job_id, cid in members if states[job_id] is not Status.Missing}
        code, message = BATCH_STOPPED["cancelled" if record.get("cancelling_at") is not None else "expired"]
        return [(json.dumps({"id": f"batch_req_{record['id']}_{entry.line}", "custom_id": entry.params["custom_id"],
                             "response": None, "error": {"code": code, "message": message}},
                            ensure_ascii=False) + "\n").encode()
                for entry in entries if entry.params["custom_id"] not in have]

    def _usage(self, done: list[str]) -> tuple[dict[str, Any], Optional[str]]:
        """OpenAI's batch usage summed over the done jobs' meta.json, and the model of the first."""
        tokens = {"prompt_tokens": 0, "generated_tokens": 0, "reasoning_tokens": 0}
        model = None
        for job_id in done:
            try:
                fd = open_dir(job_path(self.batches.workspace, OUTPUT, job_id))
            except OSError:
                continue
            try:
                meta = read_meta(fd)
            finally:
                os.close(fd)
            for name in tokens:
                tokens[name] += meta.get(name, 0)
            model = model or meta.get("model")
        return {"input_tokens": tokens["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": tokens["generated_tokens"],
                "output_tokens_details": {"reasoning_tokens": tokens["reasoning_tokens"]},
                "total_tokens": tokens["prompt_tokens"] + tokens["generated_tokens"]}, model


# ============================================================================
# 13.4 Endpoints
# ============================================================================
# POST /v1/chat/completions, /v1/completions, /v1/embeddings: a request is a job, mapped as a batch
# line (parse_batch, Work.publish) at SYNC_PRIORITY, followed by Flow (wait, follow), answered with
# its export body or as server-sent events adding up to it. Invariant: a gone client or no daemon to serve it
# cancels the job; a killed server leaves it to complete. Any Api-N thread, one per request.


SYNC_PRIORITY = 10  # a synchronous request's priority: ahead of batch lines (0) unless its body gives one
SYNC_UNSERVED_SECONDS = 10.0  # a request no running daemon can serve is cancelled after this long: 503
SYNC_UNSERVED_LOOK = 1.0  # seconds between looks at the daemons' records while a request is queued
SYNC_CUSTOM_ID = "request"  # a synchronous request's custom_id (export, status --json)
SYNC_UNSERVED_CODE = "model_not_served"  # the 503's error code
SSE_DONE = b"data: [DONE]\n\n"

# A failed job's code -> the HTTP status and OpenAI error type it is answered with (any other: 500).
# 410 for a cancel: the openai client retries 408, 409, 429 and 5xx, which would undo an operator's cancel.
FAILURE_STATUS: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request_error"),
    "context_overflow": (400, "invalid_request_error"),
    "grammar_error": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "parent_failed": (400, "invalid_request_error"),
    "cancelled": (410, "cancelled"),
    "timeout": (504, "timeout"),
    "crash_ceiling": (500, "server_error"),
    "write_error": (500, "server_error"),
    "model_error": (500, "server_error"),
    "runner_error": (500, "server_error"),
    "load_failed": (503, "server_error"),
}


class _ClientGone(Exception):
    """The client of a synchronous request disconnected (ApiCall.gone): its job is cancelled.
    Threads: raised and caught on the request's own Api-N thread."""


def _request_fields(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
    """``body`` without ``stream`` and ``stream_options`` (a batch line has neither), whether it
    streams, and whether the stream ends with a usage chunk (stream_options.include_usage)."""
    body = dict(body)
    stream, options = body.pop("stream", False), body.pop("stream_options", None)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    if stream and url == "/v1/embeddings":
        raise ApiError(400, "/v1/embeddings does not stream: stream must be false", param="stream")
    if options is None:
        return body, stream, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options must be {\"include_usage\": true|false}", param="stream_options")
    return body, stream, usage


def submit_request(workspace: str, url: str, body: dict[str, Any]) -> tuple[str, bool, bool]:
    """Queue the request ``body`` of endpoint ``url`` as one job, mapped exactly as an OpenAI
    Batch line of that url (every job parameter, refusals included), at SYNC_PRIORITY unless
    the body names a priority: (its job ID, whether it streams, whether with a usage chunk).
    ApiError 400 for a body nrvna refuses, 500 when the workspace cannot take it."""
    import json

    fields, stream, usage = _request_fields(url, body)
    line = {"custom_id": SYNC_CUSTOM_ID, "method": "POST", "url": url, "body": fields}
    data = json.dumps(line).encode("ascii")  # ASCII: a lone surrogate reaches the checks as it came
    try:
        [entry] = parse_batch(data, jsonl=True)
        params = {"priority": SYNC_PRIORITY, **entry.params}
        texts = params.pop("input", None)  # several texts to embed: publish renders them as parse_batch did
        # publish, not submit_file: one job's fsyncs (1.4 ms here) rather than a syncfs of the whole
        # filesystem (8 ms idle, and every request would flush the daemon's writes too).
        job_id = Work(workspace).publish(entry.prompt.decode("utf-8") if texts is None else texts, **params)
    except InvalidInput as err:
        message = str(err).removeprefix("line 1: ")
        named = re.match(r"body field '([^']+)'|parameter (\w+)", message)
        raise ApiError(400, message, param=named and (named.group(1) or named.group(2))) from None
    except (NrvnaError, OSError) as err:
        raise ApiError(500, f"cannot queue the request: {err}", type="server_error") from None
    return job_id, stream, usage


def _job_failure(job: Job) -> ApiError:
    """A failed job's answer: its error in OpenAI's shape, with FAILURE_STATUS's status."""
    code = job.meta.get("code") or "failed"
    status, kind = FAILURE_STATUS.get(code, (500, "server_error"))
    message = (job.error or code).strip() or code
    return ApiError(status, f"job {job.id} failed ({code}): {message}", type=kind, code=code)


def _error_event(error: ApiError) -> bytes:
    """An error in a stream already answered 200: OpenAI's error object as an event (the
    openai client raises it); no [DONE] follows."""
    return _event({"error": {"message": str(error.message), "type": error.type, "param": error.param,
                             "code": error.code}})


def _event(payload: dict[str, Any]) -> bytes:
    import json

    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _finished_body(flow: Flow, job_id: str) -> dict[str, Any]:
    """The response body of a finished job: export_record's (OpenAI's exact object), or its
    failure as ApiError."""
    job = flow.get(job_id)
    if job is None or not job.status.finished:
        raise ApiError(500, f"job {job_id} is gone (cleaned meanwhile?)", type="server_error")
    if job.status is Status.Failed:
        raise _job_failure(job)
    return export_record(job, "openai")["response"]["body"]


def _abandon_job(workspace: str, job_id: str) -> None:
    """Cancel a request's job nobody waits for any more (its client is gone, or it is refused):
    a queued one at once, a running one between two tokens (the cancel file; never waited for)."""
    try:
        cancel_job(workspace, job_id, timeout=0.0)
    except (NrvnaError, OSError) as err:
        log.warning(f"cannot cancel abandoned request job {job_id}: {err}")


class _RequestWatch:
    """Flow's ``on_look`` for a request waiting on its job: raises _ClientGone once the client
    is gone, and ApiError 503 once no live daemon could serve (or go on with) the job for
    SYNC_UNSERVED_SECONDS (looking at the daemons' records every SYNC_UNSERVED_LOOK s).
    Threads: one request's, on its Api-N thread only (no lock)."""

    def __init__(self, workspace: str, job_id: str, gone: Callable[[], bool]) -> None:
        self.workspace, self.job_id, self.gone = workspace, job_id, gone
        self.unserved_since: Optional[float] = None
        self.next_look = time.monotonic() + SYNC_UNSERVED_LOOK

    def look(self, status: Status) -> None:
        """One look at the job (``status``) found it unfinished."""
        if self.gone():
            raise _ClientGone()
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + SYNC_UNSERVED_LOOK
        why = self.unserved(status)
        if why is None:
            self.unserved_since = None
        elif self.unserved_since is None:
            self.unserved_since = now
        elif now - self.unserved_since >= SYNC_UNSERVED_SECONDS:
            raise ApiError(503, f"no running daemon serves this request: {why} (waited {SYNC_UNSERVED_SECONDS:g} s; "
                                "its job is cancelled)", type="server_error", code=SYNC_UNSERVED_CODE)

    def unserved(self, status: Status) -> Optional[str]:
        """Why no live daemon takes the job (``status``), or None: none runs on the workspace (a
        running job's died: its next recovery finds it cancelled), or none serves a queued job."""
        if not daemon_records(self.workspace):
            return "no daemon is running on the workspace"
        if status is not Status.Queued:
            return None
        return waiting_for_model(self.workspace, [self.job_id]).get(self.job_id)


def answer_request(workspace: str, job_id: str, gone: Callable[[], bool]) -> dict[str, Any]:
    """The response body of a request's job once it ends (Flow.wait); the job is cancelled if
    the client goes or no daemon serves it (_RequestWatch)."""
    flow = Flow(workspace)
    watch = _RequestWatch(workspace, job_id, gone)
    try:
        flow.wait(job_id, on_look=watch.look)
    except BaseException:
        _abandon_job(workspace, job_id)
        raise
    return _finished_body(flow, job_id)


def _endpoint(call: ApiCall, url: str) -> ApiReply:
    """A synchronous request of endpoint ``url``: its job queued, waited for, answered."""
    job_id, stream, usage = submit_request(call.workspace, url, call.json())
    headers = {"X-Nrvna-Job-Id": job_id}
    try:
        if not stream:
            return ApiReply(payload=answer_request(call.workspace, job_id, call.gone), headers=headers)
        answer = RequestStream(call.workspace, url, job_id, usage, call.gone)
        answer.start()
    except _ClientGone:  # its job is cancelled; nobody reads this answer
        raise ApiError(499, f"the client closed the request; job {job_id} is cancelled", type="cancelled") from None
    return ApiReply(stream=answer.events(), headers=dict(headers, **{"Cache-Control": "no-cache"}))


def _chat_completions(call: ApiCall) -> ApiReply:
    """POST /v1/chat/completions."""
    return _endpoint(call, "/v1/chat/completions")


def _completions(call: ApiCall) -> ApiReply:
    """POST /v1/completions."""
    return _endpoint(call, "/v1/completions")


def _embeddings(call: ApiCall) -> ApiReply:
    """POST /v1/embeddings."""
    return _endpoint(call, "/v1/embeddings")


class RequestStream:
    """One streamed answer, as OpenAI streams it: ``chat.completion.chunk`` (or
    ``text_completion``) events, ``data: [DONE]`` last. Choice 0's text goes out as partial.txt
    grows (Flow.follow); the rest of the finished body follows: what partial.txt had not yet
    shown, the other choices whole, reasoning, tool calls and logprobs each in one delta, a
    finish chunk per choice, the usage chunk (include_usage). So each choice's deltas concatenate
    to exactly the unstreamed body's text. ``start`` waits for the first text or the end (a job
    that fails before any text gets its own status); leaving the stream unfinished (the client
    gone) cancels the job. Threads: one request's, on its Api-N thread only (no lock); the
    files it reads are the daemon's, read with Flow's checked readers."""

    def __init__(self, workspace: str, url: str, job_id: str, usage: bool, gone: Callable[[], bool]) -> None:
        endpoint = ENDPOINTS[url]
        self.workspace, self.job_id, self.usage, self.chat = workspace, job_id, usage, endpoint.input == "messages"
        self.flow = Flow(workspace)
        self.head: dict[str, Any] = {"id": f"{endpoint.id_prefix}{job_id}",
                                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                                     "created": int(time.time()), "model": None, "system_fingerprint": None}
        self.sent = ""  # choice 0's text streamed so far
        self.seen = ""  # partial.txt of the job's current attempt
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        watch = _RequestWatch(workspace, job_id, gone)
        self.pieces = self.flow.follow(job_id, on_restart=self._restarted, on_look=watch.look, result=False)
        self.first: Optional[bytes] = None
        self.ended = False

    def _restarted(self) -> None:
        """The daemon runs the job again from its start (it died): its text comes again."""
        self.seen = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def start(self) -> None:
        """Wait for the job's first text, or its end: raise its failure (or the watch's
        refusal) before any byte of the answer is sent; the job is cancelled then."""
        try:
            self.first = next(self.pieces, None)
            if self.first is None and self.flow.status(self.job_id) is Status.Failed:
                _finished_body(self.flow, self.job_id)  # raises its failure
        except BaseException:
            _abandon_job(self.workspace, self.job_id)  # (a finished job is left as it is)
            raise

    def events(self) -> Iterator[bytes]:
        """The events, each ``data: {...}\\n\\n`` (bytes); abandoning them cancels the job."""
        try:
            self._model()
            if self.chat:
                yield self._chunk([self._delta(0, role="assistant", content="")])
            pieces = itertools.chain([] if self.first is None else [self.first], self.pieces)
            for piece in pieces:
                text = self._new_text(piece)
                if text:
                    yield self._chunk([self._delta(0, text)])
            yield from self._finish()
        except _ClientGone:
            return  # nobody reads on: the job is cancelled below
        except ApiError as err:  # refused while streaming (no daemon): said as an event; the job is cancelled
            _abandon_job(self.workspace, self.job_id)
            self.ended = True
            yield _error_event(err)
        finally:
            if not self.ended:
                _abandon_job(self.workspace, self.job_id)

    def _model(self) -> None:
        """The chunks' ``model``: the model the daemon runs the job on (meta.json's, once claimed)."""
        status, path = self.flow.locate(self.job_id)
        try:
            fd = open_dir(path)
        except OSError:
            return
        try:
            model = read_meta(fd).get("model")
            self.head["model"] = model if isinstance(model, str) else None
        finally:
            os.close(fd)

    def _new_text(self, piece: bytes) -> str:
        """What of partial.txt's new ``piece`` is not streamed yet: nothing while a restarted
        attempt regenerates what was sent, or once it differs (the end says so)."""
        self.seen += self.decoder.decode(piece)
        if len(self.seen) <= len(self.sent) or not self.seen.startswith(self.sent):
            return ""
        text, self.sent = self.seen[len(self.sent):], self.seen
        return text

    def _finish(self) -> Iterator[bytes]:
        """The finished job's rest: each choice's deltas and finish, the usage, [DONE]."""
        try:
            body = _finished_body(self.flow, self.job_id)
        except ApiError as err:
            self.ended = True
            yield _error_event(err)
            return
        self.ended = True
        self.head["model"] = body.get("model")
        for choice in body["choices"]:
            chunks = self._choice_chunks(choice) if self.chat else self._text_chunks(choice)
            if chunks is None:
                yield _error_event(ApiError(500, f"job {self.job_id}'s text does not go on from what was streamed "
                                                 "(a daemon died and it ran again)", type="server_error"))
                return
            for chunk in chunks:
                yield self._chunk([chunk])
        if self.usage:
            yield self._chunk([], body["usage"])
        yield SSE_DONE

    def _rest(self, index: int, text: Optional[str]) -> Optional[str]:
        """Choice ``index``'s final ``text`` past what was streamed (None: it does not go on from it)."""
        text = text or ""
        if index != 0:
            return text
        return text[len(self.sent):] if text.startswith(self.sent) else None

    def _choice_chunks(self, choice: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
        index, message = choice["index"], choice["message"]
        rest = self._rest(index, message.get("content"))
        if rest is None:
            return None
        fields = {"content": rest} if index == 0 else {"role": "assistant", "content": rest}
        chunks = [self._delta(index, **fields)] if rest or index else []
        if message.get("reasoning_content"):
            chunks.append(self._delta(index, reasoning_content=message["reasoning_content"]))
        if message.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            chunks.append(self._delta(index, tool_calls=calls))
        end = self._delta(index)
        end.update(logprobs=choice.get("logprobs"), finish_reason=choice.get("finish_reason"))
        return chunks + [end]

    def _text_chunks(self, choice: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
        index = choice["index"]
        rest = self._rest(index, choice.get("text"))
        if rest is None:
            return None
        end = self._delta(index, "")
        end.update(logprobs=choice.get("logprobs"), finish_reason=choice.get("finish_reason"))
        return ([self._delta(index, rest)] if rest else []) + [end]

    def _delta(self, index: int, text: Optional[str] = None, **fields: Any) -> dict[str, Any]:
        """A choice's chunk: ``text`` (or the delta's ``fields``; a None field left out), unfinished."""
        if not self.chat:
            return {"text": text or "", "index": index, "logprobs": None, "finish_reason": None}
        delta = {key: value for key, value in fields.items() if value is not None}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _chunk(self, choices: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> bytes:
        payload = dict(self.head, choices=choices)
        if self.usage:
            payload["usage"] = usage
        return _event(payload)


# ============================================================================
# 13.5 The server
# ============================================================================
# API_ROUTES (the one table of routes: dispatch, 405s and docs/server.md's table) and ApiServer:
# Api-IO reads each request whole, bounded in size and time; Api-N threads (a bounded pool) answer.
# Invariant: a slow or silent client holds no Api-N thread, and a connection past its bounds is dropped.


API_HOST = "127.0.0.1"
API_PORT = 8000
API_WORKERS = 64  # Api-N threads at most (started as requests need them)
# Requests read whole and queued for an Api-N thread; past it they wait in Api-IO (still counted as
# open connections, so bounded by API_CONNECTIONS), none read further until the queue has room.
API_QUEUE = 256
# Connections open at once. Past it, the oldest one still sending its request is dropped when it is
# older than API_EVICT_SECONDS; else no more are accepted until one ends (they wait in the listen backlog).
API_CONNECTIONS = 512
API_EVICT_SECONDS = 1.0
API_HEAD_SECONDS = 10.0  # a request's head, whole, from its first byte (or from the connection's start)
API_BODY_SECONDS = 30.0  # a request, whole: this, plus a second per API_BODY_RATE bytes of its body
API_BODY_RATE = 1 << 20
API_IDLE_SECONDS = 15.0  # a kept-alive connection with no new request is closed after this
API_SEND_SECONDS = 30.0  # a reply: this, plus a second per API_BODY_RATE bytes (a stream: per write)
API_LINGER_SECONDS = 1.0  # after a refusal, what the client still sends is read and dropped this long


def _models_served(workspace: str) -> list[dict[str, Any]]:
    """OpenAI's model objects for the models the workspace's live daemons serve (each once)."""
    found: dict[str, dict[str, Any]] = {}
    for record in daemon_records(workspace):
        for model in record.get("models") or ():
            name = model.get("name")
            if isinstance(name, str) and name:
                model_id = name[:-5] if name.endswith(".gguf") else name
                created = record.get("started")
                found.setdefault(model_id, {"id": model_id, "object": "model",
                                            "created": int(created) if _is_time(created) else 0,
                                            "owned_by": "nrvna"})
    return list(found.values())


def _metrics(call: ApiCall) -> ApiReply:
    return ApiReply(content=metrics_text(call.workspace).encode(),
                    content_type="text/plain; version=0.0.4; charset=utf-8")


def _list_models(call: ApiCall) -> ApiReply:
    return ApiReply(payload={"object": "list", "data": _models_served(call.workspace)})


def _get_model(call: ApiCall) -> ApiReply:
    from urllib.parse import unquote

    name = unquote(call.params["model"])
    for model in _models_served(call.workspace):
        if model["id"] == name:
            return ApiReply(payload=model)
    raise ApiError(404, f"The model {name[:200]!r} does not exist", param="model", code="model_not_found")


def _create_file(call: ApiCall) -> ApiReply:
    if call.upload is None:
        raise ApiError(400, "POST /v1/files takes a multipart/form-data body (fields purpose and file)")
    fd = os.open(call.upload, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
    try:
        parts = read_multipart(fd, os.fstat(fd).st_size, call.headers.get("content-type", ""))
        unknown = sorted(set(parts) - {"purpose", "file"})
        if unknown:
            raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0][:80]}", param=unknown[0])
        for name in ("purpose", "file"):
            if name not in parts:
                raise ApiError(400, f"Missing required parameter: '{name}'", param=name)
        purpose = multipart_field(fd, parts["purpose"], "purpose")
        filename, first, end = parts["file"]
        if filename is None:
            raise ApiError(400, "field 'file' must be a file (a part with a filename)", param="file")
        if purpose not in FILE_PURPOSES:  # before the file is copied
            raise ApiError(400, f"purpose {purpose[:40]!r} is not one of: {', '.join(FILE_PURPOSES)}",
                           param="purpose")
        return ApiReply(payload=call.files.create(file_chunks(fd, first, end), end - first, filename, purpose))
    finally:
        os.close(fd)


def _query_int(call: ApiCall, name: str, default: int, low: int, high: int) -> int:
    text = call.query.get(name)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise ApiError(400, f"{name} must be an integer from {low} to {high}", param=name)
    return int(text)


def _list_files(call: ApiCall) -> ApiReply:
    unknown = sorted(set(call.query) - {"purpose", "after", "limit", "order"})
    if unknown:
        raise ApiError(400, f"Unrecognized query parameter: {unknown[0][:80]}", param=unknown[0])
    order = call.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order")
    limit = _query_int(call, "limit", 10000, 1, 10000)
    found = call.files.list(call.query.get("purpose"), call.query.get("after"), limit + 1, order)
    data = found[:limit]
    return ApiReply(payload={"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": len(found) > limit})


def _get_file(call: ApiCall) -> ApiReply:
    return ApiReply(payload=call.files.get(call.params["file_id"]))


def _file_content(call: ApiCall) -> ApiReply:
    return ApiReply(content=call.files.content_path(call.params["file_id"]))


def _delete_file(call: ApiCall) -> ApiReply:
    return ApiReply(payload=call.files.delete(call.params["file_id"]))


def _create_batch(call: ApiCall) -> ApiReply:
    return ApiReply(payload=ApiBatches(call.workspace, call.files).create(call.json()))


def _list_batches(call: ApiCall) -> ApiReply:
    unknown = sorted(set(call.query) - {"after", "limit"})
    if unknown:
        raise ApiError(400, f"Unrecognized query parameter: {unknown[0][:80]}", param=unknown[0])
    batches = ApiBatches(call.workspace, call.files)
    return ApiReply(payload=batches.list(call.query.get("after"), call.query.get("limit")))


def _get_batch(call: ApiCall) -> ApiReply:
    return ApiReply(payload=ApiBatches(call.workspace, call.files).get(call.params["batch_id"]))


def _cancel_batch(call: ApiCall) -> ApiReply:
    return ApiReply(payload=ApiBatches(call.workspace, call.files).cancel(call.params["batch_id"]))


# method, path ({name}: one part of the path, an ID matched whole against API_IDS), handler, help.
# Dispatch, the 405s (the Allow header) and docs/server.md's table come from here.
API_ROUTES: tuple[tuple[str, str, Callable[[ApiCall], ApiReply], str], ...] = (
    ("GET", "/v1/models", _list_models, "the models the workspace's live daemons serve (OpenAI's list)"),
    ("GET", "/v1/models/{model}", _get_model, "one of them (404: no live daemon serves it)"),
    ("POST", "/v1/files", _create_file, "upload a batch file: multipart/form-data, fields `purpose` (batch) and "
                                        "`file`; up to 200 MB and 50,000 lines"),
    ("GET", "/v1/files", _list_files, "the files, newest first: `purpose`, `after`, `limit` (1-10,000), `order`"),
    ("GET", "/v1/files/{file_id}", _get_file, "a file's object"),
    ("DELETE", "/v1/files/{file_id}", _delete_file,
     "remove a file: `{\"id\", \"object\": \"file\", \"deleted\": true}`"),
    ("GET", "/v1/files/{file_id}/content", _file_content, "a file's bytes, exactly as uploaded or written"),
    ("POST", "/v1/batches", _create_batch, "create a batch: `input_file_id`, `endpoint`, `completion_window` (24h), "
                                           "`metadata`; durable once answered"),
    ("GET", "/v1/batches", _list_batches, "the batches, newest first: `after`, `limit` (1-100, 20 by default)"),
    ("GET", "/v1/batches/{batch_id}", _get_batch, "a batch's object: its status, request_counts, files"),
    ("POST", "/v1/batches/{batch_id}/cancel", _cancel_batch, "cancel a batch: cancelling, then cancelled with the "
                                                              "done lines in its output file"),
    ("POST", "/v1/chat/completions", _chat_completions, "a chat completion, run as a job ahead of batch lines "
                                                        "(`stream`: server-sent events); see Synchronous endpoints"),
    ("POST", "/v1/completions", _completions, "a text completion (legacy), as a job: see Synchronous endpoints"),
    ("POST", "/v1/embeddings", _embeddings, "embeddings of `input`, as a job: see Synchronous endpoints"),
    ("GET", "/metrics", _metrics, "the workspace's metrics in Prometheus' text format (docs/metrics.md)"),
)


def _send_all(sock: Any, data: bytes) -> None:
    """Send ``data`` within API_SEND_SECONDS and a second per API_BODY_RATE bytes (socket.timeout,
    an OSError, past that)."""
    sock.settimeout(API_SEND_SECONDS + len(data) / API_BODY_RATE)
    sock.sendall(data)


def _reply_head(status: int, content_type: str, length: Optional[int], headers: Mapping[str, str],
                keep: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_HTTP_REASONS.get(status, 'Status')}", f"Content-Type: {content_type}",
             f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("Connection: keep-alive" if keep else "Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    import ipaddress
    import socket

    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(str(address).split("%")[0]).is_loopback for address in found)


def _route_pattern(path: str) -> Any:
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path)))


class _Connection:
    """One client connection while Api-IO reads a request from it: the bytes so far, the
    deadline, the request's head and body (in memory, or an upload's in api/tmp/).

    Threads: Api-IO's alone, until the request is whole and handed to an Api-N."""

    __slots__ = ("sock", "buffer", "deadline", "since", "idle", "head", "length", "body", "received",
                 "spool", "spool_fd", "lingering")

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock, self.deadline, self.since = sock, deadline, time.monotonic()
        self.buffer = bytearray()
        self.idle = False  # kept alive, between two requests
        self.head: Optional[_Head] = None
        self.length = self.received = 0
        self.body = bytearray()
        self.spool: Optional[str] = None
        self.spool_fd = -1
        self.lingering = False

    def next_request(self, deadline: float) -> None:
        """Ready for the connection's next request (bytes already read stay in buffer)."""
        self.head, self.length, self.received, self.body, self.lingering = None, 0, 0, bytearray(), False
        self.idle, self.deadline, self.since = True, deadline, time.monotonic()

    def drop_spool(self) -> None:
        if self.spool_fd >= 0:
            os.close(self.spool_fd)
            self.spool_fd = -1
        if self.spool is not None:
            _unlink_quietly(self.spool, None)
            self.spool = None

    def close(self) -> None:
        self.drop_spool()
        with contextlib.suppress(OSError):
            self.sock.close()


def _start_request(server: "ApiServer", conn: _Connection, head: _Head, early: int) -> None:
    """Check a request's head before its body is read (the key, the length, the bound: ApiError),
    and make ready for the body (its deadline, an upload's file in api/tmp/, 100 Continue)."""
    key = server.api_key
    if key and not api_key_matches(head.headers, key):
        raise ApiError(401, "Incorrect API key provided: send the header Authorization: Bearer KEY",
                       code="invalid_api_key")
    length = head.body_length()
    limit = FILE_BYTES_LIMIT + MULTIPART_SLACK if head.is_upload() else API_BODY_LIMIT
    if length > limit:
        what = "an upload's body" if head.is_upload() else "a JSON body"
        raise ApiError(413, f"the body is {length:,} bytes; {what} may be up to {limit:,}", code="body_too_large")
    conn.head, conn.length = head, length
    conn.deadline = time.monotonic() + server.body_seconds + length / API_BODY_RATE
    if head.is_upload() and length:
        try:
            conn.spool, conn.spool_fd = server.files.new_upload()
        except OSError as err:
            raise ApiError(500, f"the upload cannot be held: {_os_error(err)}", type="server_error") from None
    if length > early and "100-continue" in head.headers.get("expect", "").lower():
        with contextlib.suppress(OSError):
            conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")


class _Reader:
    """The Api-IO thread: accepts connections and reads each request whole (its head within
    API_HEAD_SECONDS, the whole within API_BODY_SECONDS and a second per API_BODY_RATE bytes),
    refusing what is over a bound itself, then queues it for the Api-N threads.

    Threads: Api-IO alone, but give_back (any Api-N: a SimpleQueue and a pipe)."""

    def __init__(self, server: "ApiServer", listener: Any) -> None:
        import queue
        import selectors

        self.server, self.listener = server, listener
        self.selector = selectors.DefaultSelector()
        self.open: dict[int, _Connection] = {}
        self.back: Any = queue.SimpleQueue()  # connections kept alive by an Api-N thread
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self.stopping = False
        self.paused = False  # not accepting: API_CONNECTIONS are open
        self.waiting: deque[_Connection] = deque()  # requests read whole, for a full queue

    def give_back(self, conn: _Connection) -> None:
        if self.stopping:
            conn.close()
            return
        self.back.put(conn)
        with contextlib.suppress(OSError):
            os.write(self.wake_write, b"x")

    def stop(self) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):
            os.write(self.wake_write, b"x")

    def run(self) -> None:
        import selectors

        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "wake")
        try:
            while not self.stopping:
                while self.waiting and self.server.queue_request(self.waiting[0]):
                    self.waiting.popleft()
                if self.paused and (self._count() < self.server.connections or self._evictable()):
                    self._pause(False)
                for key, _ in self.selector.select(timeout=0.02 if self.waiting else 0.25):
                    try:
                        if key.data == "accept":
                            self._accept()
                        elif key.data == "wake":
                            self._woken()
                        else:
                            self._read(key.data)
                    except Exception as err:  # a bug: that connection is dropped, never the server
                        log.limited("api-io", f"API server: {type(err).__name__}: {err}")
                        if isinstance(key.data, _Connection):
                            self._forget(key.data)
                            key.data.close()
                self._expire()
        finally:
            for conn in [*self.open.values(), *self.waiting]:
                conn.close()
            self.selector.close()

    def close(self) -> None:
        """Close the wake pipe, once no Api-N thread can give a connection back."""
        os.close(self.wake_read)
        os.close(self.wake_write)

    def _watch(self, conn: _Connection) -> None:
        import selectors

        self.open[conn.sock.fileno()] = conn
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _forget(self, conn: _Connection) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(conn.sock)
        self.open.pop(conn.sock.fileno(), None)
        if self.paused and self._count() < self.server.connections:
            self._pause(False)

    def _count(self) -> int:
        return len(self.open) + len(self.waiting)

    def _accept(self) -> None:
        for _ in range(64):
            if self._count() >= self.server.connections and not self._drop_oldest():
                self._pause(True)  # until a connection ends: the rest wait in the listen backlog
                return
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as err:  # out of descriptors: take the rest once some are closed
                log.limited("api-accept", f"API server: cannot accept a connection: {_os_error(err)}")
                self._pause(True)
                return
            sock.setblocking(False)
            self._watch(_Connection(sock, time.monotonic() + self.server.head_seconds))

    def _pause(self, paused: bool) -> None:
        """Stop or start accepting connections (the listener's place in the selector)."""
        import selectors

        if paused != self.paused:
            self.paused = paused
            if paused:
                self.selector.unregister(self.listener)
            else:
                self.selector.register(self.listener, selectors.EVENT_READ, "accept")

    def _evictable(self) -> Optional[_Connection]:
        """The oldest connection still sending its request, when older than API_EVICT_SECONDS."""
        oldest = min(self.open.values(), key=lambda conn: conn.since, default=None)
        return oldest if oldest is not None and time.monotonic() - oldest.since >= API_EVICT_SECONDS else None

    def _drop_oldest(self) -> bool:
        """Drop the oldest connection still sending its request (a client that sends slowly, or
        nothing), once older than API_EVICT_SECONDS; False when none is."""
        oldest = self._evictable()
        if oldest is None:
            return False
        self._forget(oldest)
        oldest.close()
        return True

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self.wake_read, 4096)
        while not self.back.empty():
            conn = self.back.get()
            conn.sock.setblocking(False)
            self._watch(conn)  # may go past API_CONNECTIONS for a while: it was open already
            if conn.buffer:  # a request sent behind the last one
                self._take(conn, b"")

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [conn for conn in self.open.values() if conn.deadline < now]:
            self._forget(conn)
            conn.close()

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._forget(conn)
            conn.close()
        elif conn.lingering:
            pass  # a refused request's rest: dropped
        else:
            self._take(conn, data)

    def _take(self, conn: _Connection, data: bytes) -> None:
        try:
            if conn.head is None:
                if conn.idle and data:
                    conn.idle, conn.deadline = False, time.monotonic() + self.server.head_seconds
                conn.buffer += data
                end = conn.buffer.find(b"\r\n\r\n")
                if end < 0 and len(conn.buffer) <= API_HEAD_LIMIT:
                    return
                if end < 0 or end > API_HEAD_LIMIT:
                    raise ApiError(431, f"the request's head is over {API_HEAD_LIMIT} bytes")
                head, data = parse_head(bytes(conn.buffer[:end])), bytes(conn.buffer[end + 4:])
                conn.buffer = bytearray()
                _start_request(self.server, conn, head, len(data))
            self._body(conn, data)
        except ApiError as err:
            self._refuse(conn, err)

    def _body(self, conn: _Connection, data: bytes) -> None:
        need = conn.length - conn.received
        take, rest = data[:need], data[need:]
        if take:
            if conn.spool_fd >= 0:
                try:
                    write_all(conn.spool_fd, take)
                except OSError as err:
                    raise ApiError(500, f"the upload cannot be held: {_os_error(err)}", type="server_error") from None
            else:
                conn.body += take
            conn.received += len(take)
        if conn.received < conn.length:
            return
        conn.buffer = bytearray(rest)  # the next request, sent before this one's answer
        if conn.spool_fd >= 0:
            os.close(conn.spool_fd)
            conn.spool_fd = -1
        self._forget(conn)
        if self.waiting or not self.server.queue_request(conn):
            self.waiting.append(conn)  # in order, as the queue makes room

    def _refuse(self, conn: _Connection, err: ApiError) -> None:
        """Answer ``err`` from here and close: what the client still sends is read and dropped
        for API_LINGER_SECONDS, so that it reads the answer rather than a reset."""
        import socket

        body = _json_bytes(err.payload())
        conn.drop_spool()
        with contextlib.suppress(OSError):
            conn.sock.send(_reply_head(err.status, "application/json", len(body), {}, False) + body)
            conn.sock.shutdown(socket.SHUT_WR)
        conn.lingering, conn.deadline = True, time.monotonic() + API_LINGER_SECONDS
        if conn.sock.fileno() not in self.open:
            self._watch(conn)


class ApiServer:
    """The served API over a workspace (`nrvna serve`): ``start()`` listens (127.0.0.1:8000 by
    default), ``serve_forever()`` until ``request_stop()`` (a signal handler may call it),
    ``shutdown()`` closes; a context manager. Binding an address other than loopback needs an
    ``api_key`` (InvalidInput). It never loads a model: it is a client of the files.

    Threads: Main (start, serve_forever, shutdown), Api-IO (_Reader), Api-N (_work: one request
    each; at most ``workers``, started as requests wait) => requests (a queue.Queue); _threads and
    _idle under _lock; Batches (``batches``, a BatchLifecycle: started and stopped with the server)."""

    def __init__(self, workspace: str, host: str = API_HOST, port: int = API_PORT, api_key: str = "", *,
                 workers: int = API_WORKERS, connections: int = API_CONNECTIONS,
                 head_seconds: float = API_HEAD_SECONDS, body_seconds: float = API_BODY_SECONDS) -> None:
        import queue

        if type(port) is not int or not 0 <= port <= 65535:
            raise InvalidInput(f"--port {port} is not a port (0 to 65535; 0: one the system chooses)")
        if not api_key and not _is_loopback(host):
            raise InvalidInput(f"--host {host} is not a loopback address: serving it needs an API key "
                               "(--api-key or NRVNA_API_KEY)")
        self.workspace, self.host, self.port, self.api_key = workspace, host, port, api_key
        self.workers, self.connections = workers, connections
        self.head_seconds, self.body_seconds = head_seconds, body_seconds
        self.files = ApiFiles(workspace)
        self.batches = BatchLifecycle(ApiBatches(workspace, self.files))  # the Batches thread
        self.routes = [(method, _route_pattern(path), handler) for method, path, handler, _ in API_ROUTES]
        self.requests: Any = queue.Queue(API_QUEUE)
        self.reader: Optional[_Reader] = None
        self.listener: Any = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stop_asked = False

    def __enter__(self) -> "ApiServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self) -> None:
        import socket

        ensure_workspace(self.workspace)
        self.files.sweep()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self.listener = socket.create_server((self.host, self.port), family=family,
                                                 backlog=4096)  # the kernel caps it (somaxconn)
        except OSError as err:
            why = str(err.strerror or err).split(" (while attempting")[0]  # create_server's addition
            raise NrvnaError(f"cannot listen on {self.host}:{self.port}: {why}") from None
        self.listener.setblocking(False)
        self.reader = _Reader(self, self.listener)
        thread = threading.Thread(target=self.reader.run, name="Api-IO", daemon=True)
        thread.start()
        self._threads.append(thread)
        self.batches.start()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on (the port the system chose, for port 0)."""
        host, port = self.listener.getsockname()[:2]
        return host, port

    def request_stop(self) -> None:
        self._stop_asked = True  # one attribute: a signal handler may set it

    def serve_forever(self) -> None:
        while not self._stop_asked:
            time.sleep(0.2)

    def shutdown(self) -> None:
        self._stop_asked = True
        if self.reader is not None:
            self.reader.stop()
        self.batches.stop()
        with self._lock:
            threads = list(self._threads)
        with contextlib.suppress(Exception):  # queue.Empty: the requests not begun are dropped
            while True:
                conn = self.requests.get_nowait()
                if conn is not None:
                    conn.close()
        for _ in threads[1:]:
            self.requests.put(None)  # room: API_WORKERS < API_QUEUE
        for thread in threads:
            thread.join(timeout=5)
        if self.reader is not None and not any(thread.is_alive() for thread in threads):
            self.reader.close()  # else left open: a thread still answering may write to it
        if self.listener is not None:
            self.listener.close()
        self.reader = self.listener = None
        self._threads = []

    def queue_request(self, conn: _Connection) -> bool:
        """Queue a request read whole for an Api-N thread; False when API_QUEUE wait already."""
        import queue

        try:
            self.requests.put_nowait(conn)
        except queue.Full:
            return False
        with self._lock:
            if self._idle == 0 and len(self._threads) - 1 < self.workers:
                index = len(self._threads)
                thread = threading.Thread(target=self._work, name=f"Api-{index}", daemon=True)
                self._threads.append(thread)
                self._idle += 1  # counted before it runs: the next request does not start another
                thread.start()
        return True

    def _work(self) -> None:
        while True:
            conn = self.requests.get()
            with self._lock:
                self._idle -= 1
            if conn is None:
                return
            keep = False
            try:
                keep = self._answer(conn)
            except Exception as err:  # a bug: logged; the server goes on
                log.error(f"API server: {type(err).__name__}: {err}")
            reader = self.reader
            if keep and reader is not None and not self._stop_asked:
                conn.next_request(time.monotonic() + API_IDLE_SECONDS)
                reader.give_back(conn)
            else:
                conn.close()
            with self._lock:
                self._idle += 1

    def _answer(self, conn: _Connection) -> bool:
        """Answer one request; whether the connection may be kept for another."""
        head = conn.head
        assert head is not None
        try:
            reply = self._dispatch(conn, head)
        except ApiError as err:
            reply = ApiReply(err.status, err.payload())
        except NrvnaError as err:
            status = 400 if isinstance(err, InvalidInput) else 404 if isinstance(err, NoSuchJob) else 500
            reply = ApiReply(status, ApiError(status, str(err), type="server_error" if status == 500 else
                                              "invalid_request_error").payload())
        except Exception as err:  # a bug: answered and logged, never the server's end
            log.error(f"API server: {head.method} {head.target[:200]}: {type(err).__name__}: {err}")
            reply = ApiReply(500, ApiError(500, "the server failed to answer this request",
                                           type="server_error").payload())
        finally:
            conn.drop_spool()
        return self._send(conn.sock, reply, head.keep_alive())

    def _dispatch(self, conn: _Connection, head: _Head) -> ApiReply:
        from urllib.parse import parse_qsl

        path, _, text = head.target.partition("?")
        try:
            query = dict(parse_qsl(text, keep_blank_values=True, max_num_fields=100, errors="strict"))
        except (ValueError, UnicodeError):
            raise ApiError(400, "the query string cannot be read") from None
        allowed = []
        for method, pattern, handler in self.routes:
            found = pattern.fullmatch(path)
            if found is None:
                continue
            if method != head.method:
                allowed.append(method)
                continue
            for name, value in found.groupdict().items():
                if name in API_IDS and not API_IDS[name].fullmatch(value):
                    what = "File object" if name == "file_id" else name[:-3]
                    raise ApiError(404, f"No such {what}: {value[:80]}", param=name)
            call = ApiCall(self.workspace, head, path, query, bytes(conn.body), conn.spool, self.files, conn.sock)
            call.params = found.groupdict()
            return handler(call)
        if allowed:
            error = ApiError(405, f"{head.method[:16]} is not allowed on {path[:200]}: use {', '.join(allowed)}")
            return ApiReply(405, error.payload(), headers={"Allow": ", ".join(allowed)})
        raise ApiError(404, f"Invalid URL ({head.method[:16]} {path[:200]})")

    def _send(self, sock: Any, reply: ApiReply, keep: bool) -> bool:
        """Write ``reply``; whether all of it went (the connection may then be kept)."""
        sock.setblocking(True)
        try:
            if reply.stream is not None:
                return self._send_stream(sock, reply) and keep
            if reply.content is not None and not isinstance(reply.content, bytes):
                return self._send_file(sock, reply, keep)
            body = reply.content if reply.content is not None else \
                b"" if reply.payload is None else _json_bytes(reply.payload)
            _send_all(sock, _reply_head(reply.status, reply.content_type, len(body), reply.headers, keep) + body)
            return keep
        except OSError:
            return False

    def _send_stream(self, sock: Any, reply: ApiReply) -> bool:
        try:
            _send_all(sock, _reply_head(reply.status, reply.content_type, None, reply.headers, True))
            for piece in reply.stream or ():
                if piece:
                    _send_all(sock, b"%x\r\n%s\r\n" % (len(piece), piece))
            _send_all(sock, b"0\r\n\r\n")
            return True
        finally:
            close = getattr(reply.stream, "close", None)
            if close is not None:
                close()  # a generator's finally runs now: a stream cut short ends its job

    def _send_file(self, sock: Any, reply: ApiReply, keep: bool) -> bool:
        try:
            fd = os.open(str(reply.content), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            error = ApiError(404, "the file's content is gone")
            return self._send(sock, ApiReply(404, error.payload()), keep)
        try:
            size = os.fstat(fd).st_size
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return self._send(sock, ApiReply(404, ApiError(404, "the file's content is not a file").payload()),
                                  keep)
            _send_all(sock, _reply_head(reply.status, reply.content_type, size, reply.headers, keep))
            sent = 0
            while sent < size:
                chunk = os.pread(fd, min(1 << 20, size - sent), sent)
                if not chunk:
                    return False  # cut short under us: the length sent is wrong, so the connection ends
                _send_all(sock, chunk)
                sent += len(chunk)
            return keep
        finally:
            os.close(fd)


##############################################################################
# 14. CLI: parse, call the library, print. Data on stdout, messages on stderr.
##############################################################################
# Owns argument parsing, output and exit codes. Invariant: data on stdout, one-line messages on
# stderr, an exit code from EXIT_CODES; it calls the library, never a daemon's internals. The main
# thread of a client or daemon process.


# ============================================================================
# 14.1 Commands
# ============================================================================
# One _cmd_* per command and their output: JSON or lines on stdout, progress and waits that
# notice a missing daemon (_DaemonWatch) on stderr. The main thread.


# Seconds between wait/get --wait --progress lines while nothing finishes: often enough that a
# log file shows the wait is alive, rarely enough that a day's wait is a few thousand lines.
PROGRESS_EVERY = 10.0


# Seconds a wait sees no live daemon on its workspace before it says so: a daemon started
# beside the wait, or restarting, holds its lock by then; a person at the terminal learns why
# nothing moves before they wonder.
NO_DAEMON_AFTER = 3.0
DAEMON_LOOK_EVERY = 1.0  # seconds between a wait's looks at daemons/ (a few opens and flocks each)


class _Signalled(BaseException):
    """SIGINT or SIGTERM arrived while the daemon was starting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def markdown_tables() -> dict[str, str]:
    """The manual's generated tables: settings, params, exit-codes, failure-codes, hook-variables,
    caches, routes, request-errors, api-errors and metrics, from SETTINGS, PARAMS, EXIT_CODES,
    FAILURE_CODES, HOOK_VARIABLES, HOST_CACHES, API_ROUTES, FAILURE_STATUS, API_ERROR_CODES and METRICS
    (scripts/readme_tables.py writes them; a test checks them)."""
    settings = ["| variable | default | meaning |", "|---|---|---|"]
    for setting in SETTINGS.values():
        default = setting.default if setting.shown is None else setting.shown
        settings.append(f"| `{setting.env}` | {default} | {setting.help} |")
    params = ["| parameter | type | default | `submit` flag | OpenAI body | meaning |", "|---|---|---|---|---|---|"]
    for name, param in PARAMS.items():
        kind = param.describe()
        default = f"`{SETTINGS[name].env}`" if name in SETTINGS else ("—" if param.default is None else str(param.default).lower())
        flags = [param.flag] + [f for f, (target, _, _) in FLAG_SHORTHANDS.items() if target == name] if param.flag else []
        flag = ", ".join(f"`{f}`" for f in flags) or "—"
        openai = ", ".join(f"`{field}`" for field in param.openai) or "—"
        line = "" if param.jsonl else " (not a JSONL field)"
        params.append(f"| `{name}` | {kind} | {default} | {flag} | {openai} | {param.help}{line} |")
    exit_codes = ["| code | meaning |", "|---|---|"] + [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES.items()]
    failures = ["| code | the job failed because |", "|---|---|"] + [
        f"| `{code}` | {meaning} |" for code, meaning in FAILURE_CODES.items()]
    hooks = ["| variable | set for | meaning |", "|---|---|---|"] + [
        f"| `{name}` | {', '.join('`--' + hook.replace('_', '-') + '`' for hook in on)} | {meaning} |"
        for name, (on, meaning) in HOOK_VARIABLES.items()]
    request_errors = ["| code | HTTP status | error type | the job failed because |", "|---|---|---|---|"] + [
        f"| `{code}` | {FAILURE_STATUS[code][0]} | `{FAILURE_STATUS[code][1]}` | {meaning} |"
        for code, meaning in FAILURE_CODES.items()]
    caches = ["| cache | kept by | bound | holds | makes room by |", "|---|---|---|---|---|"] + [
        f"| {what} | {whose} | {f'`{bound}`' if bound.startswith('NRVNA_') else bound} | {holds} | {room} |"
        for what, whose, bound, holds, room in HOST_CACHES]
    routes = ["| method | path | what it answers |", "|---|---|---|"] + [
        f"| {method} | `{path}` | {what} |" for method, path, _, what in API_ROUTES]
    api_errors = ["| code | the served API answers it for |", "|---|---|"] + [
        f"| `{code}` | {meaning} |" for code, meaning in API_ERROR_CODES.items()]
    metrics = ["| metric | type | labels | meaning |", "|---|---|---|---|"] + [
        f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels) or '—'} | {meaning} |"
        for name, (kind, labels, meaning) in METRICS.items()]
    return {"settings": "\n".join(settings), "params": "\n".join(params), "exit-codes": "\n".join(exit_codes),
            "failure-codes": "\n".join(failures), "hook-variables": "\n".join(hooks), "caches": "\n".join(caches),
            "routes": "\n".join(routes), "request-errors": "\n".join(request_errors),
            "api-errors": "\n".join(api_errors), "metrics": "\n".join(metrics)}


def _say(message: str) -> None:
    """One line on stderr; never raises (stderr may be closed)."""
    try:
        sys.stderr.write(f"nrvna: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class _DaemonWatch:
    """A wait's look at the workspace's daemons (every DAEMON_LOOK_EVERY s, by their locks: see
    ``daemon_records``): it says on stderr when none has run for NO_DAEMON_AFTER seconds,
    again each time the last one goes, and when one is back. The wait goes on: the jobs are
    durable, and the next daemon runs them (or reruns a dead one's running job)."""

    def __init__(self, workspace: str, what: str, say: Callable[[str], None] = _say) -> None:
        self.workspace, self.what, self.say = workspace, what, say  # what: "job ID", "the jobs"
        self.looked = -math.inf
        self.none_since: Optional[float] = None  # when this absence of daemons was first seen
        self.said = False  # this absence was told
        self.seen = False  # a live daemon was seen while waiting

    def __call__(self, *_: Any) -> None:
        now = time.monotonic()
        if now - self.looked < DAEMON_LOOK_EVERY:
            return
        self.looked = now
        try:
            live = daemon_records(self.workspace)
        except OSError:
            return  # unreadable daemons/: nothing known to tell
        if live:
            if self.said:
                pids = ", ".join(str(record.get("pid")) for record in live)
                self.say(f"a daemon runs on {self.workspace} again (pid {pids}): {self.what} can run now")
            self.none_since, self.said, self.seen = None, False, True
            return
        if self.none_since is None:
            self.none_since = now
        if not self.said and now - self.none_since >= NO_DAEMON_AFTER:
            import shlex

            none = f"the daemon of {self.workspace} stopped and none runs" if self.seen else \
                f"no daemon runs on {self.workspace}"
            self.say(f"{none} (for {now - self.none_since:.0f} s): nothing will run {self.what} until one starts; "
                     f"still waiting (jobs are kept: a daemon started later runs them; start one: nrvna daemon MODEL {shlex.quote(self.workspace)})")
            self.said = True


def _print_lines(lines: Iterable[str]) -> None:
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()


def _print_json(value: Any, indent: Optional[int] = None) -> None:
    import json

    sys.stdout.write(json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=indent is not None) + "\n")
    sys.stdout.flush()


def _cmd_daemon(args: Any) -> int:
    import signal

    config = Config.from_env(**{name: getattr(args, name) for name, setting in SETTINGS.items() if setting.flags})
    configure_logging(config.log_level)
    threading.current_thread().name = "Main"
    server = Server(args.model, args.workspace, config=config, drain=args.drain, runner=args.runner)
    api = None
    if args.serve is not None:  # listening before the model loads: a port in use ends it at once
        api = ApiServer(args.workspace, args.serve[0], args.serve[1], config.api_key)
        api.start()
        log.info(f"Serving the API on {_api_url(api)}")

    starting = True

    def on_signal(signum: int, _frame: Any) -> None:
        if not starting:
            server.stop_from_signal(signum)  # no lock here: see stop_from_signal
            return
        # start() takes none of the locks request_stop takes, so it is called from here.
        log.info(f"Received {_signal_name(signum)}")
        server.request_stop()
        # Loading the model or making contexts: no job is touched yet, so end start() here.
        # From recovery on, start() sees the stop itself and hands a running job back.
        if server.processor is None:
            raise _Signalled(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.start()  # undoes itself on any exception: lock released, model freed
        starting = False
    except _Signalled as signalled:
        server.shutdown()  # idempotent: start() has already let go of what it held
        log.info("Stopped during start-up")
        return 128 + signalled.signum
    finally:
        if api is not None and starting:
            api.shutdown()
    try:
        server.serve_forever()
    finally:
        if api is not None:
            api.shutdown()
        server.shutdown()
    failure = server.failure()
    if failure:
        log.error(f"The daemon stopped: {failure}")
        return EXIT_FAILED
    return EXIT_OK


def _api_url(api: ApiServer) -> str:
    host, port = api.address
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _cmd_serve(args: Any) -> int:
    import signal

    configure_logging(setting_default("log_level"))
    threading.current_thread().name = "Main"
    key = args.api_key if args.api_key is not None else setting_default("api_key")
    api = ApiServer(args.workspace, args.host, args.port, key)
    api.start()
    signal.signal(signal.SIGINT, lambda signum, frame: api.request_stop())
    signal.signal(signal.SIGTERM, lambda signum, frame: api.request_stop())
    try:
        print(_api_url(api), flush=True)  # the base URL a client is given (the port chosen, with --port 0)
        log.info(f"Serving {args.workspace} on {_api_url(api)}{' (API key required)' if key else ''}")
        api.serve_forever()
    finally:
        api.shutdown()
    return EXIT_OK


def _stdin(what: str) -> Any:
    """Standard input's binary stream, to be read with a limit (it may never end: `< /dev/zero`)."""
    if sys.stdin is None:
        raise InvalidInput(f"{what}: stdin is closed")
    return sys.stdin.buffer


def _read_prompt(args: Any) -> Any:
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if args.prompt is None and sys.stdin is not None and sys.stdin.isatty():
        raise InvalidInput("no prompt: give PROMPT, or '-' and the prompt on stdin")
    limit = setting_default("max_prompt_bytes")
    data = _stdin("no prompt").read(limit + 1)
    if len(data) > limit:
        raise InvalidInput(f"the prompt on stdin is over {limit} bytes, the limit of a prompt (NRVNA_MAX_PROMPT_BYTES)")
    return data


def _job_params(args: Any) -> dict[str, Any]:
    """The job parameters given as ``submit`` flags (see PARAMS)."""
    params = {name: getattr(args, name) for name, param in PARAMS.items()
              if param.flag and getattr(args, name) is not None}
    for name in params:
        if PARAMS[name].gather is not None:  # a repeated flag: logit_bias's (id, bias) pairs
            params[name] = PARAMS[name].gather(params[name])
    return params


def _cmd_submit(args: Any) -> int:
    params = _job_params(args)
    strict = True if args.strict_models else None  # else NRVNA_STRICT_MODELS
    if args.dedupe and "idempotency_key" in params:
        raise InvalidInput("give --idempotency-key or --dedupe, not both")
    if args.file is None and (args.template is not None or args.id_field is not None or args.shard is not None):
        raise InvalidInput("--template, --id-field and --shard are for --file (the lines of a batch file)")
    if args.file is not None:
        if args.prompt is not None or args.wait:
            raise InvalidInput("--file takes no PROMPT and no --wait (use: nrvna wait WS --tag NAME)")
        source = _stdin("--file -") if args.file == "-" else args.file
        notes: list[str] = []
        try:
            Work(args.workspace, _say, strict).submit_file(source, tag=params.pop("tag", None), on_ids=_print_lines,
                                             notes=notes, dedupe=args.dedupe, template=args.template,
                                             id_field=args.id_field,
                                             shard=None if args.shard is None else read_shard(args.shard), **params)
        finally:
            for note in notes:
                _say(note)
        return EXIT_OK
    work = Work(args.workspace, _say, strict)
    try:
        job_id = work.publish(_read_prompt(args), dedupe=args.dedupe, **params)
    except NotDurable as err:
        print(err.job_id, flush=True)  # it is queued: a script must learn its ID
        raise
    if work.existing:
        _say(f"job {job_id} has this idempotency key already ({Flow(args.workspace).status(job_id).value}); "
             "nothing queued")
    if not args.wait:
        print(job_id, flush=True)
        return EXIT_OK
    try:
        return _emit(Flow(args.workspace), job_id, True, args.wait_timeout, False)
    except NotFinished:
        print(job_id, flush=True)  # the wait ran out, the job is queued: a script can follow it up
        raise


def _cmd_get(args: Any) -> int:
    check_ids([args.id])
    require_workspace(args.workspace)
    if args.follow:
        return _follow(Flow(args.workspace), args.id)
    return _emit(Flow(args.workspace), args.id, args.wait, args.timeout, args.json, args.progress, args.reasoning)


def _wait_saying(flow: Flow, job_id: str, timeout: Optional[float], watch: _DaemonWatch) -> Status:
    """``flow.wait``, with a line on stderr every PROGRESS_EVERY seconds and one at the end
    (get --wait --progress: a log file sees the wait is alive)."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        left = None if timeout is None else max(0.0, timeout - elapsed)
        status = flow.wait(job_id, PROGRESS_EVERY if left is None else min(PROGRESS_EVERY, left), watch)
        elapsed = time.monotonic() - start
        ended = status.finished or status is Status.Missing or (timeout is not None and elapsed >= timeout)
        _say(f"job {job_id}: {status.value} after {elapsed:.0f} s")
        if ended:
            return status


def _emit(flow: Flow, job_id: str, wait: bool, timeout: Optional[float], as_json: bool,
          progress: bool = False, reasoning: bool = False) -> int:
    """Print a job's result (stdout) or error (stderr); return the exit code for its state.
    ``progress``: with ``wait``, progress lines on stderr (get --wait --progress); ``reasoning``:
    its thinking instead of its answer (get --reasoning)."""
    watch = _DaemonWatch(flow.workspace, f"job {job_id}")  # never a silent wait
    if wait and progress:
        status = _wait_saying(flow, job_id, timeout, watch)
    else:
        status = flow.wait(job_id, timeout, watch) if wait else flow.status(job_id)
    if status is Status.Missing:
        raise NoSuchJob(f"no job {job_id} in {flow.workspace}")
    if as_json:
        job = flow.get(job_id)
        if job is None:
            raise NoSuchJob(f"no job {job_id} in {flow.workspace}")
        record = {"id": job.id, "status": job.status.value, "prompt": job.prompt, "result": job.result,
                  "error": job.error, "meta": job.meta, "params": job.params, "logprobs": job.logprobs,
                  "choices": job.choices, "reasoning": job.reasoning, "chain": flow.chain(job_id)}
        if job.message is not None:
            record.update(content=job.message["content"], tool_calls=job.message["tool_calls"])
        if job.status is Status.Done and job_param(job.params or {}, "embed"):
            record.update(result=None, embeddings=job_vectors(job))
        _print_json(record)
        return STATUS_EXIT[job.status]
    if status is Status.Done:
        data = flow.result_bytes(job_id, REASONING_FILE if reasoning else RESULT_FILE)
        if data is not None:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            return EXIT_OK
        status = flow.status(job_id)
    if status is Status.Failed:
        return _report_failure(flow, job_id)
    waited = f" after waiting {timeout:g} s" if wait and timeout is not None else ""
    raise NotFinished(f"job {job_id} is {status.value}{waited}")


def _report_failure(flow: Flow, job_id: str) -> int:
    job = flow.get(job_id)
    _say(f"job {job_id} failed: {(job.error if job and job.error else 'unknown error').rstrip()}")
    return EXIT_FAILED


def _follow(flow: Flow, job_id: str) -> int:
    """``get --follow``: the text as it is generated, then the job's exit code."""
    out = sys.stdout.buffer

    def on_restart() -> None:
        _say(f"job {job_id} was restarted; its text follows again")
        out.write(b"\n")

    for piece in flow.follow(job_id, on_restart, _DaemonWatch(flow.workspace, f"job {job_id}")):
        out.write(piece)
        out.flush()
    if flow.status(job_id) is Status.Failed:
        return _report_failure(flow, job_id)
    return EXIT_OK


def _cmd_status(args: Any) -> int:
    flow = Flow(args.workspace)
    if args.daemon:
        _print_json(daemon_info(args.workspace), indent=1)
        return EXIT_OK
    if args.tag is not None or not args.ids:
        code = EXIT_OK
        if args.tag is not None:
            counts = {status.value: 0 for _, status in STATE_DIRS}
            try:
                ids, states = flow.select(args.ids, args.tag)
            except NoSuchJob as err:  # counts of nothing, but say so: the tag may be a typo
                _say(f"error: {err}")
                ids, states, code = [], {}, EXIT_MISSING
            for job_id in ids:
                counts[states[job_id].value] += 1
            counts["total"] = len(ids)
            eta = _tag_eta(args.workspace, {job_id: states[job_id] for job_id in ids})
            if args.json:
                counts.update(jobs_per_second=eta[0], eta_seconds=eta[1])  # type: ignore[arg-type]
            elif eta[2]:
                _say(f"tag {args.tag}: {eta[2]}")
        else:
            require_workspace(args.workspace)
            counts = flow.counts()
            lanes = {str(priority): len(ids) for priority, ids in flow.lanes()}
            if args.json:
                counts["lanes"] = lanes  # type: ignore[assignment]
            elif set(lanes) - {"0"}:
                counts.update({f"lane {priority}": count for priority, count in lanes.items()})
        if args.json:
            _print_json(counts)
        else:
            _print_lines(f"{state} {count}" for state, count in counts.items())
        return code
    check_ids(args.ids)
    require_workspace(args.workspace)
    statuses = [flow.status(job_id) for job_id in args.ids]
    # A queued job's place in its lane (position, lane size, priority). stdout keeps exactly the
    # state word, the contract of shell tests like [ "$(nrvna status ws $id)" = queued ].
    places: dict[str, tuple[int, int, int]] = {}
    if Status.Queued in statuses:
        for priority, ids in flow.lanes():
            places.update({job_id: (n, len(ids), priority) for n, job_id in enumerate(ids, 1)})
    waiting = waiting_for_model(args.workspace, [j for j, s in zip(args.ids, statuses) if s is Status.Queued])
    if args.json:
        report: dict[str, dict[str, Any]] = {}
        for job_id, s in zip(args.ids, statuses):
            report[job_id] = {"status": s.value}
            if s is Status.Queued and job_id in places:
                n, of, priority = places[job_id]
                report[job_id].update(lane=priority, position=n, of=of)
            if job_id in waiting:
                report[job_id]["waiting"] = waiting[job_id]
        _print_json(report)
    else:
        _print_lines(s.value for s in statuses)
        for job_id in waiting:  # never a silent wait
            _say(f"{job_id}: {waiting[job_id]}")
        if sys.stderr is not None and sys.stderr.isatty():  # for the person at the terminal only
            for job_id, s in zip(args.ids, statuses):
                if s is Status.Queued and job_id in places:
                    n, of, priority = places[job_id]
                    _say(f"{job_id}: {n} of {of} in lane {priority}")
    for worst in (Status.Missing, Status.Failed, Status.Queued, Status.Running):
        if worst in statuses:
            return STATUS_EXIT[worst]
    return EXIT_OK


def _tag_eta(workspace: str, states: dict[str, Status]) -> tuple[Optional[float], Optional[float], str]:
    """``status --tag``'s rate of finishes (jobs/s), its ETA in seconds (0: nothing left) and its
    line ("" when nothing is left); None before there is a rate (see finish_rate)."""
    left = sum(1 for status in states.values() if not status.finished)
    rate = finish_rate(recent_finishes(workspace, states), time.time())
    if not left:
        return None if rate is None else round(rate, 4), 0, ""
    if rate is None:
        return None, None, (f"{left} of {len(states)} jobs left, ETA unknown: fewer than 2 of its jobs ended in "
                            f"the last {RATE_SECONDS / 60:g} min")
    return round(rate, 4), round(left / rate, 1), (f"{left} of {len(states)} jobs left, {_eta_text(left, rate)} "
                                                   f"at {rate:.2f} jobs/s (its latest finishes)")


def _eta_text(left: int, rate: Optional[float]) -> str:
    """"ETA 1h02m", "ETA 3m05s", "ETA 40s", or "ETA unknown" without a rate."""
    if rate is None:
        return "ETA unknown"
    seconds = int(min(left / rate, 1e9))
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"ETA {hours}h{rest // 60:02d}m"
    return f"ETA {rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"ETA {rest}s"


def _cmd_wait(args: Any) -> int:
    flow = Flow(args.workspace)
    as_lines = args.progress  # lines a log file keeps, whatever stderr is
    progress = as_lines or (not args.quiet and sys.stderr is not None and sys.stderr.isatty())
    start, tokens = time.monotonic(), 0
    seen: Optional[set[str]] = None  # finished before the wait: not in the tokens/s
    times: list[float] = []  # finish times: the selection's latest before the wait, then each one seen (the ETA)
    said_at, said_finished, unsaid = -math.inf, -1, ""

    def draw(states: dict[str, Status]) -> None:
        nonlocal seen, tokens, times, said_at, said_finished, unsaid
        finished = [j for j, s in states.items() if s.finished]
        if seen is None:
            seen, times = set(finished), recent_finishes(args.workspace, states)
        for job_id in finished:
            if job_id not in seen:
                job = flow.get(job_id)
                tokens += int(job.meta.get("generated_tokens") or 0) if job else 0
                if job is not None and job.meta.get("finished") is not None:  # a time: job_meta checked it
                    times.append(float(job.meta["finished"]))
                seen.add(job_id)
        if len(times) > 2 * RATE_FINISHES:
            times = sorted(times)[-RATE_FINISHES:]
        done = sum(1 for s in states.values() if s is Status.Done)
        now = time.monotonic()
        text = _progress_text(done, len(finished) - done, len(states), finish_rate(times, time.time()),
                              tokens / max(now - start, 1e-6))
        if not as_lines:
            _draw_progress(text)
            return
        # A line when jobs have finished (at most one a second, however fast they finish)
        # and every PROGRESS_EVERY seconds while none do: a log file's pulse.
        if now - said_at >= PROGRESS_EVERY or (len(finished) != said_finished and now - said_at >= 1.0):
            _say(f"{text} after {now - start:.0f} s")
            said_at, said_finished, unsaid = now, len(finished), ""
        elif len(finished) != said_finished:
            unsaid = f"{text} after {now - start:.0f} s"

    if not args.quiet:  # never a silent wait: say which jobs wait for a model nobody serves
        ids, states = flow.select(args.ids, args.tag)
        reasons: dict[str, list[str]] = {}
        for job_id, reason in waiting_for_model(args.workspace, [j for j in ids if states[j] is Status.Queued]).items():
            reasons.setdefault(reason, []).append(job_id)
        for reason, waiting in reasons.items():
            _say(f"{waiting[0]} {reason}" if len(waiting) == 1 else f"{len(waiting)} jobs ({waiting[0]}, ...) {reason}")
    watch = _DaemonWatch(args.workspace, "the jobs", _say_below_progress if progress and not as_lines else _say)

    def look(states: dict[str, Status]) -> None:
        if any(not s.finished and s is not Status.Missing for s in states.values()):
            watch()  # never a silent wait: say when no daemon runs to finish them
        if progress:
            draw(states)

    states = flow.wait_all(args.ids, args.tag, args.timeout, look)
    if unsaid:  # the last jobs ended within a second of a line: the log still gets the final count
        _say(unsaid)
    elif progress and not as_lines:
        sys.stderr.write("\n")
    unfinished = sum(1 for s in states.values() if not s.finished and s is not Status.Missing)
    failed = sum(1 for s in states.values() if s is Status.Failed)
    removed = sum(1 for s in states.values() if s is Status.Missing)
    if unfinished:
        _say(f"{unfinished} of {len(states)} jobs not finished after {args.timeout:g} s")
    if removed:
        _say(f"{removed} of {len(states)} jobs were removed while waiting (nrvna clean)")
        return EXIT_MISSING
    if unfinished:
        return EXIT_UNFINISHED
    if failed:
        _say(f"{failed} of {len(states)} jobs failed")
        return EXIT_FAILED
    return EXIT_OK


def _progress_text(done: int, failed: int, total: int, rate: Optional[float], token_rate: float) -> str:
    """done / failed / total, jobs/s over the latest finishes (finish_rate; "?" before there is a
    rate), generated tokens/s while we waited, and the ETA ("ETA unknown" without a rate)."""
    shown = "?" if rate is None else f"{rate:.1f}"
    return (f"{done} done / {failed} failed / {total} total  {shown} jobs/s  {token_rate:.0f} tok/s  "
            f"{_eta_text(total - done - failed, rate)}")


def _say_below_progress(message: str) -> None:
    """``_say`` on a line of its own under the progress line drawn in place (which goes on
    below it)."""
    try:
        sys.stderr.write("\n")
    except (OSError, ValueError):
        pass
    _say(message)


def _draw_progress(text: str) -> None:
    """The progress line on a terminal, redrawn in place."""
    try:
        sys.stderr.write(f"\r{text}   ")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _cmd_export(args: Any) -> int:
    out = sys.stdout if args.output is None else args.output
    notes: list[str] = []
    try:
        exported, unfinished = Flow(args.workspace).export(out, args.ids, args.tag, args.format, args.errors, notes,
                                                           args.ids_file)
    finally:
        for note in notes:
            _say(note)
    if unfinished:
        _say(f"{unfinished} of {unfinished + exported} jobs are not finished and were left out (wait first: nrvna wait)")
        return EXIT_UNFINISHED
    return EXIT_OK


def _cmd_merge(args: Any) -> int:
    """``merge --input FILE PART... -o OUT``: the shards' exports in the input's order, each
    line once; OUT is written only when the merge is whole (or with --partial)."""
    _refuse_output_among(args.output, args.input, args.parts)  # before anything is read or written
    entries = parse_batch(*_batch_source(args.input, None, None))  # its custom_ids as submit --file reads them
    requests = {e.params["custom_id"]: (e.line, request_digest(e.prompt, e.params)) for e in entries}
    notes: list[str] = []
    try:
        lines, missing, conflicts = merge_parts([e.params["custom_id"] for e in entries], _part_lines(args.parts),
                                                requests, notes)
    finally:
        for note in notes:
            _say(note)
    for what, ids in (("missing from every part", missing), ("given different results by two parts", conflicts)):
        if ids:
            shown = ", ".join(ids[:20]) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
            _say(f"{len(ids)} of {len(entries)} lines are {what}: {shown}")
    whole = not missing and not conflicts
    if whole or args.partial:
        target = _ExportTarget(args.output)
        try:
            for line in lines:
                target.write(line.decode("utf-8", "replace"))
            target.commit()
        except BaseException:
            target.abort()
            raise
    elif args.output != "-":
        _say(f"{args.output} not written: the merge is not whole (--partial writes what there is)")
    return EXIT_OK if whole else EXIT_FAILED if conflicts else EXIT_UNFINISHED


def _part_lines(names: list[str]) -> Iterator[tuple[str, Iterator[tuple[int, bytes]]]]:
    """Each merge part's name and its lines, read one part at a time (``read_part``'s bounds).
    A part that cannot be read is a usage error (2), not a conflict (1)."""
    for name in names:
        try:
            handle = open(name, "rb")
        except OSError as err:
            raise InvalidInput(f"cannot read {name}: {_os_error(err)}") from None
        with handle:
            yield name, read_part(handle, name)


def _refuse_output_among(output: str, source: str, parts: list[str]) -> None:
    """InvalidInput when ``-o`` names the input or a part (the same file, by device and inode:
    through a link, a symlink or another path too): the merge would replace what it reads."""
    if output == "-":
        return
    try:
        written = os.stat(output)
    except OSError:
        return  # no file there yet (or none to stat): nothing read can be it
    if stat.S_ISCHR(written.st_mode):
        return  # a terminal or /dev/null: written through, never replaced
    for what, name in [("the input", source)] + [("the part", part) for part in parts]:
        try:
            read = os.stat(name)
        except OSError:
            continue
        if (read.st_dev, read.st_ino) == (written.st_dev, written.st_ino):
            raise InvalidInput(f"-o {output} is {what} {name}: merge never writes over a file it reads; "
                               "give another OUT")


def _cmd_cancel(args: Any) -> int:
    named = set(args.ids)
    worst, left_alone, gone = EXIT_OK, 0, 0
    for job_id, outcome, message in cancel_jobs(args.workspace, args.ids, args.tag, args.timeout):
        if outcome == "cancelled":
            print(job_id, flush=True)
        elif outcome == "finished" and job_id not in named:
            left_alone += 1  # a tag's finished jobs: nothing to cancel, not an error
        elif outcome == "missing":
            gone += 1
        else:
            _say(message)
            worst = max(worst, EXIT_UNFINISHED if outcome == "pending" else EXIT_FAILED)
    if left_alone:
        _say(f"{left_alone} finished jobs of tag {args.tag} left alone")
    if gone:
        _say(f"{gone} jobs were removed while being cancelled (a clean); skipped")
    return worst


def _cmd_retry(args: Any) -> int:
    codes = None if args.code is None else [c.strip() for c in args.code.split(",") if c.strip()]
    worst, queued, gone = EXIT_OK, 0, 0
    for job_id, outcome, message in retry_jobs(args.workspace, args.ids, args.tag, args.failed, codes):
        if outcome == "queued":
            print(job_id)
            queued += 1
        elif outcome == "missing":
            gone += 1
        elif outcome == "refused" and job_id in args.ids:
            _say(message)
            worst = EXIT_FAILED
    sys.stdout.flush()
    if gone:
        _say(f"{gone} jobs moved or were removed while being retried (another retry, or a clean); skipped")
    if not queued:
        _say("no failed job matched; nothing queued")
    return worst


def _cmd_clean(args: Any) -> int:
    both = not args.done and not args.failed
    notes: list[str] = []
    removed = clean_jobs(args.workspace, args.older_than, done=args.done or both, failed=args.failed or both,
                         dry_run=args.dry_run, notes=notes)
    for note in notes:
        _say(note)
    _print_lines(removed)
    _say(f"{'would remove' if args.dry_run else 'removed'} {len(removed)} jobs")
    return EXIT_OK


def _cmd_stop(args: Any) -> int:
    notes: list[str] = []
    try:
        pids = stop_daemon(args.workspace, args.timeout, args.pid, notes)
    finally:
        for note in notes:
            _say(note)
    _say(f"daemon{'s' if len(pids) > 1 else ''} (pid {', '.join(map(str, pids))}) stopped")
    return EXIT_OK


def _cmd_metrics(args: Any) -> int:
    text = metrics_text(args.workspace)
    if args.output in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
        return EXIT_OK
    # node_exporter's textfile collector reads *.prom files at any time: FILE is written whole
    # under a temporary name of its own (not *.prom), fsynced and renamed over it (export's policy).
    target = _ExportTarget(args.output)
    try:
        target.write(text)
        target.commit()
    except BaseException:
        target.abort()
        raise
    return EXIT_OK


def _cmd_events(args: Any) -> int:
    import json
    import select

    require_workspace(args.workspace)
    if args.tag is not None:
        require_tag(args.workspace, args.tag)
    since = _since(args.workspace, args.since) if args.since is not None else None
    out = sys.stdout
    poller = select.poll()
    try:
        poller.register(out.fileno(), 0)  # a pipe whose reader left reports POLLERR
    except (AttributeError, OSError, ValueError):
        pass  # not a file (a test's capture): only a failed write ends it

    def alive() -> bool:
        return not poller.poll(0)

    for events in iter_events(args.workspace, since, args.tag, args.follow, alive):
        out.write("".join(json.dumps(event, ensure_ascii=False) + "\n" for event in events))
        out.flush()
    return EXIT_OK


def _since(workspace: str, text: str) -> float:
    """``events --since``: now, a duration ago (90s, 10m), epoch seconds, an ISO time (UTC
    unless it says), or a job's ID (from its submission on)."""
    import datetime

    text = text.strip()
    if text == "now":
        return time.time()
    if re.fullmatch(r"\d+(\.\d+)?[smhd]", text):
        return time.time() - _duration(text)
    status, path = locate_job(workspace, text)
    if status is not Status.Missing:
        fd = open_dir(path)
        try:
            return read_meta(fd).get("submitted") or submitted_time(text, fd) or 0.0
        finally:
            os.close(fd)
    if GENERATED_ID.fullmatch(text):
        raise NoSuchJob(f"no job {text} in {workspace}")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    try:
        when = datetime.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise InvalidInput(f"--since {text!r}: give now, a duration (10m), epoch seconds, an ISO time "
                           "(2026-11-24T12:00:00Z) or a job ID") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def _duration(text: str) -> float:
    """Seconds in ``90s``, ``90m``, ``12h`` or ``7d``. The unit is required: ``clean
    --older-than 5`` deletes jobs, and a user who means 5 days must not lose them in 5 s."""
    import argparse

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] not in units:
        raise argparse.ArgumentTypeError(f"{text!r} has no unit: write it as {text}s, {text}m, {text}h or {text}d")
    number, unit = text[:-1], text[-1]
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (like 90m, 12h, 7d)") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


# ============================================================================
# 14.2 Arguments and main
# ============================================================================
# The argparse parser, built from COMMANDS and the tables' flags, and main(argv) -> exit code:
# every NrvnaError becomes one line on stderr and its exit code. The main thread.


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _daemon_arguments(parser: Any) -> None:
    parser.add_argument("model", metavar="MODEL", nargs="+",
                        help="GGUF path, a name in NRVNA_MODELS_DIR, or a directory of GGUFs; several serve several "
                             "models (the first is the default)")
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("--drain", action="store_true", help="process everything queued, then exit 0 (1 when jobs are left that no live daemon serves)")
    parser.add_argument("--serve", type=_host_port, metavar="[HOST:]PORT", help="serve the API as `nrvna serve` "
                        "does, from this process (a client of the files like any other)")
    for name, setting in SETTINGS.items():  # the settings with a flag of their own
        if setting.flags:
            hooked = [var for var, (hooks, _) in HOOK_VARIABLES.items() if name in hooks]
            env = f"; sets {', '.join(hooked)}" if hooked else ""
            default = setting.default if setting.shown is None else setting.shown
            default = f", default {default}" if default != "" else ""
            if setting.kind is not str:
                kind: dict[str, Any] = {"type": setting.kind}
            else:  # a hook's command, a size, or one of the setting's choices
                kind = {"metavar": "|".join(setting.choices) if setting.choices else
                        "SIZE" if setting.check in (_check_size, _check_pending) else
                        "KEY" if name == "api_key" else "CMD"}
            parser.add_argument(*setting.flags, dest=name, help=f"{setting.help}{env} ({setting.env}{default})", **kind)


def _host_port(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (HOST 127.0.0.1 when absent; ``[::1]:PORT`` for an IPv6 address)."""
    import argparse

    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not [HOST:]PORT")
    return host or API_HOST, int(port)


def _serve_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("--host", default=API_HOST, help=f"the address to listen on (default {API_HOST}; any other "
                        "than loopback needs an API key)")
    parser.add_argument("--port", type=int, default=API_PORT, metavar="P", help=f"the port (default {API_PORT}; 0: "
                        "one the system chooses, printed)")
    parser.add_argument("--api-key", metavar="KEY", help=SETTINGS["api_key"].help + " (NRVNA_API_KEY, which "
                        "keeps the key out of the process list)")


def _param_arguments(parser: Any) -> None:
    """One flag per job parameter that has one (PARAMS), and the shorthands (FLAG_SHORTHANDS)."""
    for name, param in PARAMS.items():
        if not param.flag:
            continue
        default = f" (default: {SETTINGS[name].env})" if name in SETTINGS else ""
        shorthands = [(flag, value, text) for flag, (target, value, text) in FLAG_SHORTHANDS.items() if target == name]
        group = parser.add_mutually_exclusive_group() if shorthands else parser
        if param.read is not None:
            metavar, read = param.read
            action = "append" if param.gather is not None else "store"
            group.add_argument(param.flag, dest=name, type=read, action=action, metavar=metavar, help=param.help + default)
        elif param.kind is bool:
            group.add_argument(param.flag, dest=name, action="store_const", const=True, help=param.help + default)
        elif param.kind is list:
            group.add_argument(param.flag, dest=name, action="append", metavar="TEXT", help=param.help + default)
        elif isinstance(param.kind, tuple):
            group.add_argument(param.flag, dest=name, choices=param.kind, help=param.help + default)
        else:
            metavar = {int: "N", float: "X", str: "TEXT"}[param.kind]
            group.add_argument(param.flag, dest=name, type=param.kind, metavar=metavar, help=param.help + default)
        for flag, value, text in shorthands:
            group.add_argument(flag, dest=name, action="store_const", const=value, help=text)


def _submit_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("prompt", metavar="PROMPT", nargs="?")
    parser.add_argument("--file", metavar="FILE", help="queue every line of FILE ('-' = stdin): *.jsonl holds JSON "
                        "lines (nrvna's or OpenAI Batch requests), any other file one prompt per line; the flags "
                        "below are defaults for every line")
    template = parser.add_mutually_exclusive_group()
    template.add_argument("--template", metavar="TEXT", help="with --file: the file holds records (JSONL objects, or "
                          "CSV with a header row); each fills TEXT's {field}s ({{ and }} are braces) and is kept as "
                          "the job's metadata")
    template.add_argument("--template-file", metavar="FILE", type=_read_template, dest="template",
                          help="--template, read from FILE")
    parser.add_argument("--id-field", metavar="NAME", help="with --template: the field that gives each job's "
                        "custom_id (default: line-N)")
    parser.add_argument("--shard", metavar="I/N", help="with --file: queue only shard I of N (0 <= I < N), chosen by "
                        "a hash of each line's custom_id: N nodes given the same file take each line once between "
                        "them (I/N from a scheduler: $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    parser.add_argument("--wait", action="store_true", help="wait and print the result instead of the ID")
    parser.add_argument("--wait-timeout", type=_positive_float, metavar="S", help="with --wait: give up after S seconds (exit 4)")
    parser.add_argument("--dedupe", action="store_true", help="queue identical work once: the idempotency key is "
                        "derived from the prompt and every parameter (each line's own, with --file)")
    parser.add_argument("--strict-models", action="store_true", help="refuse a job whose model matches no known "
                        "model (exit 2 naming the line and the models known; nothing queued), instead of queuing "
                        "it for the daemon's model with a note (NRVNA_STRICT_MODELS=1)")
    _param_arguments(parser)


def _status_arguments(parser: Any) -> None:
    _selection_arguments(parser)
    parser.add_argument("--daemon", action="store_true", help="every running daemon's record, a JSON list (exit 3: none)")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def _selection_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("ids", metavar="ID", nargs="*")
    parser.add_argument("--tag", metavar="NAME", help="every job submitted with this tag")


def _wait_arguments(parser: Any) -> None:
    _selection_arguments(parser)
    parser.add_argument("--timeout", type=_positive_float, metavar="S", help="give up after S seconds (exit 4)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on a terminal")
    parser.add_argument("--progress", action="store_true", help="progress as lines on stderr, even when it is not "
                        f"a terminal (a log file): when jobs finish, and every {PROGRESS_EVERY:g} s")


def _export_arguments(parser: Any) -> None:
    _selection_arguments(parser)
    parser.add_argument("--format", choices=tuple(EXPORT_FORMATS), default="jsonl",
                        help="; ".join(f"{name}: {form.help}" for name, form in EXPORT_FORMATS.items()))
    parser.add_argument("-o", "--output", metavar="FILE", help="write FILE atomically instead of stdout")
    parser.add_argument("--errors", metavar="FILE", help="failed jobs' lines go to FILE instead")
    parser.add_argument("--ids", metavar="FILE", dest="ids_file", help="with --format f32: the rows' side file "
                        "(default: -o's FILE.ids; needed when -o is a device, a FIFO or under /dev or /proc)")


def _merge_arguments(parser: Any) -> None:
    parser.add_argument("parts", metavar="PART", nargs="+", help="the shards' exports (jsonl or openai); each "
                        "line's request_sha256 must match FILE's line of its custom_id")
    parser.add_argument("--input", metavar="FILE", required=True, help="the batch file the shards were given")
    parser.add_argument("-o", "--output", metavar="OUT", required=True, help="write OUT atomically ('-': stdout); "
                        "never the input or a PART")
    parser.add_argument("--partial", action="store_true", help="write the lines there are even when some are "
                        "missing or in conflict (the exit status still says so)")


def _cancel_arguments(parser: Any) -> None:
    _selection_arguments(parser)
    parser.add_argument("--timeout", type=_positive_float, default=10.0, metavar="S",
                        help="how long to wait for the daemon to stop a running job (default 10)")


def _retry_arguments(parser: Any) -> None:
    _selection_arguments(parser)
    parser.add_argument("--failed", action="store_true", help="every failed job")
    parser.add_argument("--code", metavar="CODE,...", help="only jobs that failed with these codes: "
                        + ", ".join(FAILURE_CODES))


def _events_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("--tag", metavar="NAME", help="only the jobs submitted with this tag")
    parser.add_argument("--since", metavar="TIME|ID", help="only changes at or after TIME: now, a duration ago "
                        "(10m), epoch seconds, an ISO time (UTC unless it says), or a job's ID (its submission)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new changes as they happen")


def _metrics_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("-o", "--output", metavar="FILE", help="write FILE atomically instead of stdout (for "
                        "node_exporter's textfile collector: a FILE.prom in its directory)")


def _clean_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("--older-than", type=_duration, required=True, metavar="DURATION",
                        help="finished more than this long ago: 90m, 12h, 7d")
    parser.add_argument("--done", action="store_true", help="only done jobs")
    parser.add_argument("--failed", action="store_true", help="only failed jobs")
    parser.add_argument("--dry-run", action="store_true", help="print what would go; remove nothing")


def _stop_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("--timeout", type=_positive_float, metavar="S", help="give up waiting after S seconds (exit 4)")
    parser.add_argument("--pid", type=int, metavar="N", help="stop only the daemon with pid N (default: every daemon)")


def _get_arguments(parser: Any) -> None:
    parser.add_argument("workspace", metavar="WORKSPACE")
    parser.add_argument("id", metavar="ID")
    parser.add_argument("--wait", action="store_true", help="wait until the job is finished")
    parser.add_argument("--timeout", type=_positive_float, metavar="S", help="with --wait: give up after S seconds (exit 4)")
    parser.add_argument("--progress", action="store_true", help="with --wait: a line on stderr every "
                        f"{PROGRESS_EVERY:g} s and at the end, even when it is not a terminal (a log file)")
    parser.add_argument("--json", action="store_true", help="the whole job as one JSON object")
    parser.add_argument("--follow", action="store_true", help="print the text as it is generated, then exit "
                        "with the job's code")
    parser.add_argument("--reasoning", action="store_true", help="a thinking model's thinking (reasoning.txt) "
                        "instead of its answer: empty when it has none")


def _build_parser(only: Optional[str] = None) -> Any:
    """The CLI's parser; with ``only``, just that command's arguments (argparse's set-up is
    a large part of a client's start-up time)."""
    import argparse

    class OneLineParser(argparse.ArgumentParser):
        """A usage error is one line, as every other refusal: the usage is what --help shows."""

        def error(self, message: str) -> Any:
            found = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (int|float|_positive_float|_duration) value: (.*)",
                                 message)
            if found:
                flag, kind, value = found.groups()
                message = f"{flag} must be {'an integer' if kind == 'int' else 'a number'}, not {value}"
            self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")

    env_help = "\n".join(f"  {s.env:<24} {str(s.default if s.shown is None else s.shown):<10} {s.help}"
                         for s in SETTINGS.values())
    codes = ", ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items())
    parser = OneLineParser(
        prog="nrvna", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="A durable, asynchronous job queue for local LLM inference. A job is a "
                    "directory; its location is its state.",
        epilog=f"exit codes: {codes}\n\nenvironment (daemon):\n" + env_help)
    parser.add_argument("--version", action="version", version=f"nrvna {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary, description, add_arguments, handler in COMMANDS:
        # No abbreviations: a typo (--max-token) is an error, not another flag's prefix.
        command = commands.add_parser(name, help=summary, description=description, allow_abbrev=False)
        if only in (None, name):
            add_arguments(command)
        command.set_defaults(handler=handler, parser=command)  # main's errors point to this command's --help
    return parser


def main(argv: Optional[list[str]] = None, *, runner: Any = None) -> int:
    """Run the nrvna CLI; return its exit code. ``runner`` replaces llama.cpp in ``daemon``
    (the tests run real daemon processes this way; MODEL is then ignored)."""
    argv = sys.argv[1:] if argv is None else argv
    named = [a for a in argv[:1] if a in {c[0] for c in COMMANDS}]
    parser = _build_parser(named[0] if named else None)
    try:
        args, extra = parser.parse_known_args(argv)
    except InvalidInput as err:  # a flag's value its reader refused as input, not as usage
        _say(f"error: {err}")
        return err.exit_code
    # argparse gives an optional positional (submit's PROMPT) its value only before the flags:
    # `submit WS --embed TEXT` would leave TEXT unrecognized. Take one such word as the prompt.
    if extra and getattr(args, "prompt", "") is None and len(extra) == 1 and (extra[0] == "-" or not extra[0].startswith("-")):
        args.prompt, extra = extra[0], []
    if extra:
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    args.runner = runner
    try:
        return args.handler(args)
    except NrvnaError as err:
        _say(f"error: {err}")
        return err.exit_code
    except BrokenPipeError:
        # The reader went away (`nrvna get ... | head -c 10`): that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    except OSError as err:
        where = f"{err.filename}: " if getattr(err, "filename", None) else ""
        _say(f"error: {where}{_os_error(err)}")
        return EXIT_FAILED


# name, summary, description, arguments, handler
COMMANDS = (
    ("daemon", "load a model and work the queue",
     "Load MODEL once and process WORKSPACE's queue until SIGINT/SIGTERM (in-flight jobs go back "
     "to the queue).", _daemon_arguments, _cmd_daemon),
    ("submit", "queue a prompt; print its job ID",
     "Queue a prompt. It comes from PROMPT, or from stdin when PROMPT is '-' or absent and stdin "
     "is not a terminal.", _submit_arguments, _cmd_submit),
    ("status", "state of jobs, or counts per state",
     "With IDs: one state per line (queued running done failed missing). Without: the count in "
     "each state.", _status_arguments, _cmd_status),
    ("get", "print a job's result",
     "Print result.txt exactly; a failed job's error goes to stderr (exit 1).", _get_arguments, _cmd_get),
    ("wait", "wait until jobs are finished",
     "Return when every named job (IDs, --tag; default: every job) is done (exit 0) or failed (1); "
     "3 an unknown ID, 4 timeout. Draws a progress line on a terminal's stderr.", _wait_arguments, _cmd_wait),
    ("export", "write finished jobs' results",
     "One line per finished job in submission order; unfinished jobs are left out (exit 4).",
     _export_arguments, _cmd_export),
    ("merge", "put the shards' exports back together",
     "Write the PARTs' lines in the order of --input's lines, each custom_id once; OUT is written only when "
     "whole, unless --partial. Exit 0: every line came back once. 1: two parts give one line different "
     "results (each such line named on stderr with the two parts and lines), even if some are missing too. "
     "4: some lines are missing from "
     "every part (each named). 2, nothing written: a usage error, named with its part and line: -o names "
     "the input or a part; a part cannot be read, has a line that is not an export line or over the limit, a "
     "custom_id the input lacks, or a request_sha256 saying it answers another request than the input's line "
     "(a part of another batch).", _merge_arguments, _cmd_merge),
    ("cancel", "cancel queued or running jobs",
     "A queued job goes to failed/ (code cancelled); a running one stops between tokens and "
     "does the same. Finished jobs are left alone (exit 1).", _cancel_arguments, _cmd_cancel),
    ("retry", "queue failed jobs again",
     "Failed jobs go back to the queue with attempts reset; earlier errors stay in meta.json.",
     _retry_arguments, _cmd_retry),
    ("events", "print jobs' changes of state as JSON lines",
     "One JSON object per change, in time order: {time, id, custom_id, tag, from, to, code}, to being "
     "queued, running, done, failed, requeued or cancelled. Replays what the jobs' directories hold "
     "and exits; --follow then prints each new change until SIGINT or a closed pipe.",
     _events_arguments, _cmd_events),
    ("metrics", "print the workspace's figures for Prometheus",
     "The workspace's jobs by state, model and tag, failures by code, tokens, the oldest queued job's age and "
     "each live daemon's models and memory, in Prometheus' text format (what a server's GET /metrics answers).",
     _metrics_arguments, _cmd_metrics),
    ("clean", "remove old finished jobs",
     "Remove done and/or failed jobs finished more than DURATION ago; never queued or running ones.",
     _clean_arguments, _cmd_clean),
    ("serve", "serve OpenAI's API over the workspace",
     "Answer OpenAI's Files API and /v1/models (docs/server.md) over HTTP from WORKSPACE's files until "
     "SIGINT/SIGTERM; prints the base URL. It never loads a model or starts a daemon: start one beside it "
     "(or `daemon --serve`).", _serve_arguments, _cmd_serve),
    ("stop", "stop the daemon gracefully",
     "Ask the daemon holding WORKSPACE to stop (SIGTERM: in-flight jobs go back to the queue) "
     "and wait until it has; exit 3 if none runs.", _stop_arguments, _cmd_stop),
)


if __name__ == "__main__":
    raise SystemExit(main())
