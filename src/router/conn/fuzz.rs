//! Differential fuzzing of the request reader (issue 15): the same bytes, sent on one
//! connection and then closed, go through what the router does with them — its fast path
//! (`parse_head`, `FastRequest::into_request`, the body by its length) for as long as it takes
//! the requests, hyper's server for the rest — and through hyper's HTTP/1 server alone. Every
//! request the fast path serves must be one hyper's server reads the same (method, version,
//! target, headers in order, body), and where the fast path hands over, the requests after
//! must be the ones hyper reads there (so both split pipelined requests at the same byte).
//! Input the fast path does not take is hyper's alone, by construction: nothing to compare.

use super::{parse_head, Head, MAX_HEAD};
use crate::router::fuzz_driver::{self, body, eol, escaped, headers, message, mutate, mutations};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use proptest::prelude::*;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A request as the handler behind the reader gets it.
#[derive(Debug, PartialEq)]
struct Seen {
    method: String,
    version: hyper::Version,
    uri: String,
    headers: Vec<(String, String)>,
    /// `None`: the body did not arrive whole.
    body: Option<String>,
}

impl Seen {
    fn of(parts: &hyper::http::request::Parts, body: Option<&[u8]>) -> Self {
        Seen {
            method: parts.method.to_string(),
            version: parts.version,
            uri: parts.uri.to_string(),
            headers: parts
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), escaped(v.as_bytes())))
                .collect(),
            body: body.map(escaped),
        }
    }
}

/// Where the router's own reading of a connection ended.
#[derive(Debug)]
enum After {
    /// Handed to hyper from this byte on.
    Hyper(usize),
    /// Closed without an answer: at the end of the input (`true`) or waiting for the rest of
    /// a head or body that never came.
    Closed(bool),
}

/// `max_body_bytes`' default.
const MAX_BODY: usize = 4 << 20;

/// The requests the router's fast path serves from `input`, and where it stops.
fn router_reads(input: &[u8]) -> (Vec<Seen>, After) {
    let mut served = Vec::new();
    let mut at = 0;
    loop {
        let buf = &input[at..];
        if buf.is_empty() {
            return (served, After::Closed(true));
        }
        let (head_len, req) = match parse_head(buf, MAX_BODY) {
            None if buf.len() > MAX_HEAD => return (served, After::Hyper(at)),
            None => return (served, After::Closed(false)),
            Some(Head::Complete(n, Some(req))) => (n, req),
            Some(_) => return (served, After::Hyper(at)),
        };
        let whole = head_len + req.body_len;
        if buf.len() < whole {
            return (served, After::Closed(false));
        }
        let message = Bytes::copy_from_slice(&buf[..whole]);
        let Some(request) = req.into_request(&message, message.slice(head_len..)) else {
            return (served, After::Hyper(at));
        };
        let (parts, _) = request.into_parts();
        served.push(Seen::of(&parts, Some(&buf[head_len..whole])));
        at += whole;
    }
}

/// The requests hyper's HTTP/1 server reads from `input` (then end of input).
fn hyper_reads(rt: &tokio::runtime::Runtime, input: &[u8]) -> Result<Vec<Seen>, String> {
    let seen = Rc::new(RefCell::new(Vec::new()));
    let record = seen.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let record = record.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.ok().map(|b| b.to_bytes());
            record.borrow_mut().push(Seen::of(&parts, body.as_deref()));
            Ok::<_, std::convert::Infallible>(hyper::Response::new(Empty::<Bytes>::new()))
        }
    });
    let done = rt.block_on(async {
        let (client, server) = tokio::io::duplex(1 << 20);
        let conn = hyper::server::conn::http1::Builder::new()
            .half_close(true)
            .serve_connection(hyper_util::rt::TokioIo::new(server), service);
        let (mut rd, mut wr) = tokio::io::split(client);
        let feed = async {
            let _ = wr.write_all(input).await;
            let _ = wr.shutdown().await;
        };
        let drain = async {
            let mut sink = Vec::new();
            let _ = rd.read_to_end(&mut sink).await;
        };
        tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(conn, feed, drain)
        })
        .await
    });
    if done.is_err() {
        return Err("hyper's server did not finish within 10 s".into());
    }
    Ok(seen.take())
}

/// Compare; `Ok(true)` when the fast path served at least one request.
fn check(rt: &tokio::runtime::Runtime, input: &[u8]) -> Result<bool, String> {
    let (mut want, after) = router_reads(input);
    if want.is_empty() {
        // Nothing served by the fast path: hyper's verdict applies by construction.
        return Ok(false);
    }
    let exact = match after {
        After::Hyper(at) => {
            want.extend(hyper_reads(rt, &input[at..])?);
            true
        }
        After::Closed(all) => all,
    };
    let got = hyper_reads(rt, input)?;
    let same = if exact {
        got == want
    } else {
        got.len() >= want.len() && got[..want.len()] == want[..]
    };
    if same {
        Ok(true)
    } else {
        Err(format!(
            "router (fast path, then {after:?}): {want:#?}\nhyper's server alone: {got:#?}"
        ))
    }
}

/// One request: request line, headers, body, with variants of each part.
fn request() -> impl Strategy<Value = Vec<u8>> {
    let method = prop_oneof![
        12 => Just("POST"),
        1 => Just("GET"),
        1 => Just("post"),
        1 => Just("PUT"),
        1 => Just("POSTX"),
    ];
    let target = prop_oneof![
        12 => Just("/v1/completions".to_string()),
        6 => Just("/v1/chat/completions".to_string()),
        4 => prop::sample::select(&[
            "/v1/completions?x=1",
            "/v1/completions?q=\"",
            "/v1/completions#frag",
            "/v1/completions?a=b#c",
            "/v1/completions?a=%zz",
            "/v1/completions?\x7f",
            "/v1/completions?\u{e9}",
            "/v1/completions?a b",
            "http://x/v1/completions",
            "/v1/models",
            "*",
            "/v1/completions/",
            "//v1/completions",
            "/v1/completions?",
        ][..]).prop_map(str::to_string),
        1 => prop_oneof![8 => Just(100usize), 2 => Just(5000), 1 => Just(70_000)]
            .prop_map(|n| format!("/v1/completions?{}", "q".repeat(n))),
    ];
    let version = prop_oneof![
        30 => Just("HTTP/1.1"),
        1 => Just("HTTP/1.0"),
        1 => Just("HTTP/2.0"),
        1 => Just("http/1.1"),
        1 => Just("HTTP/1.10"),
        1 => Just("HTTP/1.1 "),
    ];
    let space = prop_oneof![30 => Just(" "), 1 => Just("  "), 1 => Just("\t")];
    let lead = prop_oneof![12 => Just(""), 1 => Just("\r\n"), 1 => Just("\n")];
    (
        (lead, method, space, target, version, eol()),
        headers(),
        eol(),
        body(),
    )
        .prop_map(
            |((lead, method, space, target, version, eol1), hs, eol2, body)| {
                message(
                    &[lead, method, space, &target, " ", version, eol1],
                    &hs,
                    eol2,
                    &body,
                )
            },
        )
}

/// One or two pipelined requests, then byte-level mutations.
fn input() -> impl Strategy<Value = Vec<u8>> {
    (
        request(),
        prop::option::weighted(0.3, request()),
        mutations(),
    )
        .prop_map(|(mut first, second, muts)| {
            if let Some(second) = second {
                first.extend_from_slice(&second);
            }
            mutate(&mut first, &muts);
            first
        })
}

/// Fixed corpus: checked on every run before the random inputs. Regressions go here.
const CORPUS: &[&[u8]] = &[
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello",
    b"POST /v1/chat/completions?x=1 HTTP/1.1\r\ncontent-length: 0\r\nconnection: keep-alive\r\n\r\n",
    // Pipelined: the split point.
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcPOST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\nde",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcGET /health HTTP/1.1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcPOST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nxyz\r\n0\r\n\r\n",
    // CL.TE / TE.CL: never the fast path's.
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
    // Content-Length variants.
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: +3\r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3,3\r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 003\r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: \t3 \r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: \xc2\xa03\r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999999999999999999\r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length : 3\r\n\r\nabc",
    // obs-fold, bare LF.
    b"POST /v1/completions HTTP/1.1\r\nx-a: 1\r\n 2\r\ncontent-length: 3\r\n\r\nabc",
    b"POST /v1/completions HTTP/1.1\ncontent-length: 3\n\nabc",
    // Found: equal duplicate Content-Lengths (the fast path passed both on, hyper keeps one).
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 0\r\ncontent-length: 0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3\r\ncontent-length:\t3\r\n\r\nabc",
    // Incomplete body: the router waits, nothing to compare past the served ones.
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcPOST /v1/completions HTTP/1.1\r\ncontent-length: 9\r\n\r\nde",
];

#[test]
fn request_reader_agrees_with_hyper_server() {
    let rt = fuzz_driver::runtime();
    fuzz_driver::run(
        "request reader vs hyper's server",
        CORPUS,
        input(),
        |bytes| check(&rt, bytes),
    );
}
