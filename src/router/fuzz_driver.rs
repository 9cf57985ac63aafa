//! Test-only: the differential fuzz harness's machinery — the router's one hand-written HTTP
//! reader, the request reader of the client side, against hyper's server (`conn::fuzz`; the
//! upstream side is hyper's client itself). A bounded-time run of proptest cases, byte-level
//! mutations of a serialized message, escaping of a failing input so it can go into the
//! harness's corpus, and a runtime for the in-memory exchanges with hyper.
//!
//! `CACHEROUTE_FUZZ_SECONDS` (default 5) bounds each harness; `CACHEROUTE_FUZZ_SEED` replays a
//! run (every run prints its seed); `CACHEROUTE_FUZZ_SURVEY=1` prints each divergence (shrunk)
//! and goes on, failing at the end, to list several at once.

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// How long each harness runs.
fn budget() -> Duration {
    let secs = std::env::var("CACHEROUTE_FUZZ_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(5.0);
    Duration::from_secs_f64(secs.max(0.0))
}

/// `bytes` as a Rust byte-string literal body (`\r`, `\n`, `\"`, `\xNN`).
pub(super) fn escaped(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}

/// A single-threaded runtime with a clock, for the in-memory exchanges with hyper.
pub(super) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
}

/// Check every `corpus` input, then inputs from `strategy` until the time budget is spent;
/// print executions and executions per second. `check` returns how the input went
/// (`Ok(true)`: the hand-written side took it, so something was compared) or the divergence
/// in words. Panics with the (shrunk) input, escaped, on the first divergence.
pub(super) fn run<S>(
    name: &str,
    corpus: &[&[u8]],
    strategy: S,
    check: impl Fn(&[u8]) -> Result<bool, String>,
) where
    S: Strategy<Value = Vec<u8>>,
{
    for (i, case) in corpus.iter().enumerate() {
        if let Err(e) = check(case) {
            panic!(
                "{name}: corpus case {i} diverges:\n  b\"{}\"\n{e}",
                escaped(case)
            );
        }
    }
    let seed = std::env::var("CACHEROUTE_FUZZ_SEED")
        .ok()
        .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
    let start = Instant::now();
    let deadline = start + budget();
    let (execs, taken) = (Cell::new(0u64), Cell::new(0u64));
    let survey = std::env::var_os("CACHEROUTE_FUZZ_SURVEY").is_some();
    let mut found = 0u64;
    let mut batch = 0u64;
    while Instant::now() < deadline {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&batch.to_le_bytes());
        batch += 1;
        let config = Config {
            cases: 64,
            failure_persistence: None,
            max_shrink_time: 60_000,
            ..Config::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &key));
        let result = runner.run(&strategy, |input| {
            execs.set(execs.get() + 1);
            match check(&input) {
                Ok(took) => {
                    taken.set(taken.get() + u64::from(took));
                    Ok(())
                }
                Err(e) => Err(TestCaseError::fail(format!(
                    "input (add it to the corpus):\n  b\"{}\"\n{e}",
                    escaped(&input)
                ))),
            }
        });
        match result {
            Ok(()) => {}
            Err(TestError::Fail(reason, _)) if survey => {
                found += 1;
                println!(
                    "{name}: divergence (seed {seed:x}, batch {}): {reason}",
                    batch - 1
                );
            }
            Err(TestError::Fail(reason, _)) => {
                panic!(
                    "{name}: divergence (seed {seed:x}, batch {}): {reason}",
                    batch - 1
                )
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{name}: {} corpus cases, {} executions in {secs:.1} s ({:.0}/s), {} taken by our reader, seed {seed:x}",
        corpus.len(),
        execs.get(),
        execs.get() as f64 / secs.max(1e-9),
        taken.get(),
    );
    assert_eq!(found, 0, "{name}: {found} divergences (above)");
}

/// One byte-level change to a serialized message.
#[derive(Debug, Clone)]
pub(super) enum Mutation {
    /// Flip bit `bit` of the byte at the index.
    Flip(Index, u8),
    /// Insert a byte at the index.
    Insert(Index, u8),
    /// Delete up to `n` bytes from the index.
    Delete(Index, usize),
    /// Repeat up to `n` bytes from the index right after themselves.
    Duplicate(Index, usize),
}

/// Mostly none, sometimes one to three.
pub(super) fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<Index>(), 1usize..12).prop_map(|(i, n)| Mutation::Delete(i, n)),
        (any::<Index>(), 1usize..40).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
    ];
    prop_oneof![4 => Just(Vec::new()), 1 => prop::collection::vec(one, 1..4)]
}

/// Apply `muts` to `msg` in order.
pub(super) fn mutate(msg: &mut Vec<u8>, muts: &[Mutation]) {
    for m in muts {
        if msg.is_empty() {
            return;
        }
        match *m {
            Mutation::Flip(ref i, bit) => {
                let at = i.index(msg.len());
                msg[at] ^= 1 << bit;
            }
            Mutation::Insert(ref i, b) => {
                let at = i.index(msg.len() + 1);
                msg.insert(at, b);
            }
            Mutation::Delete(ref i, n) => {
                let at = i.index(msg.len());
                let end = (at + n).min(msg.len());
                msg.drain(at..end);
            }
            Mutation::Duplicate(ref i, n) => {
                let at = i.index(msg.len());
                let end = (at + n).min(msg.len());
                let copy = msg[at..end].to_vec();
                msg.splice(end..end, copy);
            }
        }
    }
}

/// A header's value: literal bytes, or the message's body length written in one of
/// [`length_form`]'s ways, off by `delta`.
#[derive(Debug, Clone)]
pub(super) enum Val {
    Lit(Vec<u8>),
    Len(u8, i64),
}

/// One header line: name, separator (`": "`, `":"`, `" : "`…), value, line end.
#[derive(Debug, Clone)]
pub(super) struct Hdr {
    name: Vec<u8>,
    sep: &'static str,
    val: Val,
    eol: &'static str,
}

/// The ways a length is written, the classic smuggling variants among them.
const LENGTH_FORMS: u8 = 19;

fn length_form(form: u8, n: u64) -> Vec<u8> {
    let digits = n.to_string();
    let s = match form {
        1 => format!("+{n}"),
        2 => format!(" {n}"),
        3 => format!("{n},{n}"),
        4 => format!("{n}, {n}"),
        5 => format!("{} {}", &digits[..1], &digits[1..]),
        6 => format!("0x{n:x}"),
        7 => format!("00{n}"),
        8 => "99999999999999999999999".into(),
        9 => format!("\u{a0}{n}"),
        10 => format!("{n}\u{a0}"),
        11 => format!("\t{n}\t"),
        12 => format!("{n} "),
        13 => format!("-{n}"),
        14 => format!("{n}.0"),
        15 => String::new(),
        16 => "18446744073709551615".into(),
        17 => format!("{n},{}", n + 1),
        18 => format!("{n},"),
        _ => digits,
    };
    s.into_bytes()
}

/// Line ends: mostly CRLF, sometimes a bare LF or CR.
pub(super) fn eol() -> impl Strategy<Value = &'static str> {
    prop_oneof![40 => Just("\r\n"), 3 => Just("\n"), 1 => Just("\r"), 1 => Just("\r\r\n")]
}

fn sep() -> impl Strategy<Value = &'static str> {
    prop_oneof![20 => Just(": "), 2 => Just(":"), 1 => Just(" : "), 1 => Just(":\t"), 1 => Just(":  ")]
}

fn name_case(names: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(names).prop_map(|n| n.as_bytes().to_vec())
}

fn lit(values: &'static [&'static str]) -> impl Strategy<Value = Val> {
    prop::sample::select(values).prop_map(|v| Val::Lit(v.as_bytes().to_vec()))
}

/// `n` bytes drawn from `alphabet` by a generator seeded with `seed` (one proptest value
/// per string rather than one per byte: generation is most of a case's cost in a debug build).
fn drawn(seed: u64, n: usize, alphabet: &[u8]) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            // splitmix64
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            alphabet[((z ^ (z >> 31)) % alphabet.len() as u64) as usize]
        })
        .collect()
}

/// Up to `max` bytes from `alphabet`.
fn drawn_bytes(alphabet: &'static [u8], max: usize) -> impl Strategy<Value = Vec<u8>> {
    (any::<u64>(), 0..=max).prop_map(move |(seed, n)| drawn(seed, n, alphabet))
}

/// Any byte value.
const ANY: &[u8] = &{
    let mut all = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        all[i] = i as u8;
        i += 1;
    }
    all
};

/// Header names' characters (RFC 9110 tchar).
const TCHAR: &[u8] =
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~";

/// Header field values a proxy reads: bytes a header may hold (obs-text included), weighted
/// to the visible ones, and a few it may not.
const VALUE: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ abcdef012345\t \x80\xa0\xff\xc3\xa9\x00\x7f\r\n\x0b";

fn value_bytes() -> impl Strategy<Value = Vec<u8>> {
    drawn_bytes(VALUE, 16)
}

/// A header from the pool: `Content-Length` and `Transfer-Encoding` in their smuggling
/// variants (weighted towards the plain length), `Connection`, `Expect`, `Upgrade` and the
/// other hop-by-hop headers, obs-fold continuations, long values, arbitrary names and values.
pub(super) fn header() -> impl Strategy<Value = Hdr> {
    let length_names = &[
        "Content-Length",
        "content-length",
        "CONTENT-LENGTH",
        "Content_Length",
        "Content-Length\u{a0}",
        " Content-Length",
    ][..];
    let delta =
        prop_oneof![10 => Just(0i64), 1 => Just(-1), 1 => Just(1), 1 => Just(4), 1 => Just(-1000)];
    let form = prop_oneof![8 => Just(0u8), 4 => 0..LENGTH_FORMS];
    let length = (
        prop_oneof![8 => Just(b"content-length".to_vec()), 2 => name_case(length_names)],
        (form, delta).prop_map(|(f, d)| Val::Len(f, d)),
    );
    let coding = (
        name_case(&[
            "Transfer-Encoding",
            "transfer-encoding",
            "Transfer_Encoding",
            "TE",
        ]),
        lit(&[
            "chunked",
            "Chunked",
            " chunked",
            "chunked ",
            "gzip, chunked",
            "chunked, gzip",
            "xchunked",
            "chunked, chunked",
            "identity",
            "",
            "chunked\u{a0}",
            "gzip,chunked",
            ",chunked",
            "chunked,",
        ]),
    );
    let connection = (
        name_case(&["Connection", "connection", "Proxy-Connection"]),
        lit(&[
            "close",
            "keep-alive",
            "keep-alive",
            "Keep-Alive",
            "keep-alive ,KEEP-ALIVE",
            "upgrade",
            "keep-alive, x-foo",
            "close, x-foo",
            "x-foo, keep-alive",
            "keep-alive,",
            "",
            "keep-alive, upgrade",
            "TE, trailers",
            "keep-alive\u{a0}",
            "content-length",
            "transfer-encoding",
        ]),
    );
    let other = prop_oneof![
        1 => (
            name_case(&["Expect", "expect"]),
            lit(&["100-continue", "100-Continue", "foo"])
        ),
        1 => (name_case(&["Upgrade", "upgrade"]), lit(&["h2c", "websocket", ""])),
        4 => (
            name_case(&[
                "x-foo",
                "X-Foo",
                "keep-alive",
                "te",
                "trailer",
                "proxy-authenticate",
                "host",
                "Host",
                "content-type",
                "x-cacheroute-key",
                "date",
            ]),
            lit(&["1", "x", "timeout=5", "trailers", "application/json", "x-foo", "a, b"])
        ),
        // obs-fold: a continuation line.
        1 => (
            Just(b"x-fold".to_vec()),
            lit(&["a\r\n b", "a\r\n\tb", "a\n b", "a\r\n"])
        ),
        1 => (
            Just(b"x-long".to_vec()),
            prop_oneof![8 => Just(1000usize), 2 => Just(9000), 1 => Just(70_000)]
                .prop_map(|n| Val::Lit(vec![b'v'; n]))
        ),
        3 => (
            (any::<u64>(), 1usize..12).prop_map(|(seed, n)| drawn(seed, n, TCHAR)),
            value_bytes().prop_map(Val::Lit)
        ),
        1 => (
            drawn_bytes(ANY, 8),
            value_bytes().prop_map(Val::Lit)
        ),
    ];
    let pair = prop_oneof![2 => length, 1 => coding, 2 => connection, 8 => other];
    (pair, sep(), eol()).prop_map(|((name, val), sep, eol)| Hdr {
        name,
        sep,
        val,
        eol,
    })
}

/// The headers of a message: mostly a plain `content-length` (where in the list: `at`) and a
/// few from the pool, sometimes a great many plain ones (past header-count limits).
#[derive(Debug, Clone)]
pub(super) struct Headers {
    plain_length: Option<Index>,
    pool: Vec<Hdr>,
    many: usize,
}

pub(super) fn headers() -> impl Strategy<Value = Headers> {
    (
        prop::option::weighted(0.8, any::<Index>()),
        prop::collection::vec(header(), 0..4),
        prop_oneof![30 => Just(0usize), 1 => 55usize..130],
    )
        .prop_map(|(plain_length, pool, many)| Headers {
            plain_length,
            pool,
            many,
        })
}

/// Serialize `headers` for a message whose body is `body_len` bytes.
fn put_headers(out: &mut Vec<u8>, headers: &Headers, body_len: usize) {
    let plain = headers
        .plain_length
        .as_ref()
        .map(|i| i.index(headers.pool.len() + 1));
    for (i, h) in headers.pool.iter().enumerate() {
        if plain == Some(i) {
            out.extend_from_slice(format!("content-length: {body_len}\r\n").as_bytes());
        }
        out.extend_from_slice(&h.name);
        out.extend_from_slice(h.sep.as_bytes());
        match &h.val {
            Val::Lit(v) => out.extend_from_slice(v),
            Val::Len(form, delta) => {
                let n = (body_len as i64 + delta).max(0) as u64;
                out.extend_from_slice(&length_form(*form, n));
            }
        }
        out.extend_from_slice(h.eol.as_bytes());
    }
    if plain == Some(headers.pool.len()) {
        out.extend_from_slice(format!("content-length: {body_len}\r\n").as_bytes());
    }
    for i in 0..headers.many {
        out.extend_from_slice(format!("x-many-{i}: {i}\r\n").as_bytes());
    }
}

/// A message: its first line's pieces, the headers, the empty line's end, the body.
pub(super) fn message(first: &[&str], headers: &Headers, end: &str, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + body.len());
    for piece in first {
        out.extend_from_slice(piece.as_bytes());
    }
    put_headers(&mut out, headers, body.len());
    out.extend_from_slice(end.as_bytes());
    out.extend_from_slice(body);
    out
}

/// A chunked body for `data`: chunk sizes, size-line variants, extensions, trailers and the
/// last chunk written in the ways readers disagree on.
pub(super) fn chunked() -> impl Strategy<Value = Vec<u8>> {
    let size_form = prop_oneof![
        10 => Just("{x}"),
        1 => Just("{X}"),
        1 => Just("0{x}"),
        1 => Just(" {x}"),
        1 => Just("{x} "),
        1 => Just("+{x}"),
        1 => Just("0x{x}"),
        1 => Just("{x}\t;a=b"),
        1 => Just("{x};a=b"),
        1 => Just("{x}; ext=\"q\""),
        1 => Just("{x};\u{a0}"),
        1 => Just("{x};a\nb"),
        1 => Just("{x};a\rb"),
        1 => Just("{x}\u{a0}"),
        1 => Just("-{x}"),
        1 => Just("{x}_"),
        1 => Just("{x};e=LONG"),
    ];
    let chunk = (
        (any::<u64>(), 1usize..24).prop_map(|(seed, n)| drawn(seed, n, ANY)),
        size_form,
        eol(),
        prop_oneof![8 => Just("\r\n"), 1 => Just("\n"), 1 => Just(""), 1 => Just("XX")],
    );
    let last = prop_oneof![
        6 => Just("0\r\n\r\n"),
        1 => Just("000\r\n\r\n"),
        1 => Just("0;x=y\r\n\r\n"),
        1 => Just("0\r\nx-t: 1\r\n\r\n"),
        1 => Just("0\r\nx-t: 1\r\nx-u: 2\r\n\r\n"),
        1 => Just("0\r\nbad trailer\r\n\r\n"),
        1 => Just("0\r\nx-t: 1\nx-u: 2\r\n\r\n"),
        1 => Just("0\r\nx-t:1\r\r\n\r\n"),
        1 => Just("0\r\ncontent-length: 5\r\n\r\n"),
        1 => Just("0\n\n"),
        1 => Just("0\r\n"),
        1 => Just("0\r\n\r"),
        1 => Just("0 \r\n\r\n"),
        1 => Just("00000000000000000000\r\n\r\n"),
        1 => Just("10000000000000000\r\n\r\n"),
        1 => Just(""),
    ];
    (prop::collection::vec(chunk, 0..4), last).prop_map(|(chunks, last)| {
        let mut out = Vec::new();
        for (data, form, eol, after) in chunks {
            let line = form
                .replace("{x}", &format!("{:x}", data.len()))
                .replace("{X}", &format!("{:X}", data.len()))
                .replace("LONG", &"e".repeat(5000));
            out.extend_from_slice(line.as_bytes());
            out.extend_from_slice(eol.as_bytes());
            out.extend_from_slice(&data);
            out.extend_from_slice(after.as_bytes());
        }
        out.extend_from_slice(last.as_bytes());
        out
    })
}

/// A body: raw bytes (sized by its length headers) or a chunked body.
pub(super) fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => drawn_bytes(ANY, 40),
        3 => chunked(),
    ]
}
