//! The proxy's failure path as values: what went wrong with one attempt ([`AttemptError`]),
//! whether it may be retried ([`AttemptError::retryable`], the retry rule), what it does to
//! the destination's standing ([`AttemptError::health`]) and what the client is answered when
//! it ends the request ([`AttemptError::answer`]). `proxy`'s retry loop consults these and
//! holds no rule of its own; this file holds no I/O.
//!
//! The retry rule: a request is retried once, on another destination, only when nothing can
//! be generating it on the first — the connection could not be made, or it failed or closed
//! before any byte of an answer, or the engine refused it with a 503 (or the destination left
//! the backends before anything was sent). A slow destination (no response or first body byte
//! within the first-byte timeout) may still be generating: a 504, not retried. A malformed
//! answer is a 502; an engine's own 502/504 is passed on.

use axum::http::StatusCode;
use std::time::Duration;

/// The attempts a request gets: the first and one retry.
pub(crate) const ATTEMPTS: u8 = 2;

/// Why one attempt failed before any byte of its answer went to the client. `A` is the
/// destination's own answer (the proxy's response in hand; anything in tests).
pub(crate) enum AttemptError<A> {
    /// The destination left the backends (discovery) between its choice and the send:
    /// nothing was sent.
    Removed(String),
    /// The request could not be addressed to the destination (its target is not a URI).
    BadTarget(String),
    /// The connection could not be made, or it failed or closed before any byte of an
    /// answer: the destination's side is gone, and nothing runs there.
    Connection(String),
    /// An answer began but was malformed or cut inside its head (or switched protocols).
    Malformed(String),
    /// No response head within the first-byte timeout.
    NoResponse(Duration),
    /// A head, but no first body byte within the first-byte timeout.
    NoFirstByte(Duration),
    /// The body broke before its first byte.
    BodyBroke(String),
    /// The destination answered 502, 503 or 504 itself; `answer` is passed on as it is when
    /// no retry takes the request.
    Answered { status: StatusCode, answer: A },
}

/// What an attempt's failure does to its destination.
#[derive(Debug, PartialEq)]
pub(crate) enum Health {
    /// Marked down at once (and the plan repaired); the log says why.
    Down(String),
    /// Counted as a first-byte timeout; it stays up (its probes decide).
    Slow,
    /// Counted and logged as a broken stream; it stays up.
    Broke(String),
    /// Nothing: it stays up, uncounted but for the attempt's error.
    Unchanged,
}

/// What the client is answered when a request ends without an answer streamed to it.
#[derive(Debug, PartialEq)]
pub(crate) enum Answer<A> {
    /// The destination's own answer, passed on as it is.
    PassOn(A),
    /// The router's JSON error.
    Error(ErrorBody),
}

/// The router's own JSON error: its status, `type` and message.
#[derive(Debug, PartialEq)]
pub(crate) struct ErrorBody {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
}

impl<A> AttemptError<A> {
    /// The retry rule: whether another destination may take the request (nothing can be
    /// running on this one).
    pub fn retryable(&self) -> bool {
        match self {
            AttemptError::Removed(_) | AttemptError::Connection(_) => true,
            AttemptError::Answered { status, .. } => *status == StatusCode::SERVICE_UNAVAILABLE,
            // A slow destination may still be generating it; a broken or malformed answer
            // began there (a 502/504 may be a gateway in front of a generation still running).
            AttemptError::BadTarget(_)
            | AttemptError::Malformed(_)
            | AttemptError::NoResponse(_)
            | AttemptError::NoFirstByte(_)
            | AttemptError::BodyBroke(_) => false,
        }
    }

    /// The status the attempt counts as (and the client gets, but for an answer passed on).
    pub fn status(&self) -> StatusCode {
        match self {
            AttemptError::Answered { status, .. } => *status,
            AttemptError::NoResponse(_) | AttemptError::NoFirstByte(_) => {
                StatusCode::GATEWAY_TIMEOUT
            }
            AttemptError::Removed(_)
            | AttemptError::BadTarget(_)
            | AttemptError::Connection(_)
            | AttemptError::Malformed(_)
            | AttemptError::BodyBroke(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// What went wrong, in words (the log's and the client's).
    pub fn message(&self) -> String {
        match self {
            AttemptError::Removed(m)
            | AttemptError::BadTarget(m)
            | AttemptError::Connection(m)
            | AttemptError::Malformed(m) => m.clone(),
            AttemptError::NoResponse(limit) => format!("no response within {limit:?}"),
            AttemptError::NoFirstByte(limit) => format!("no first body byte within {limit:?}"),
            AttemptError::BodyBroke(e) => format!("response body broke before its first byte: {e}"),
            AttemptError::Answered { status, .. } => format!("answered {status}"),
        }
    }

    /// What the failure does to the destination.
    pub fn health(&self) -> Health {
        match self {
            AttemptError::Connection(m) => {
                Health::Down(format!("a request's connection failed: {m}"))
            }
            AttemptError::NoResponse(_) | AttemptError::NoFirstByte(_) => Health::Slow,
            AttemptError::BodyBroke(e) => Health::Broke(format!(
                "the response body broke before its first byte: {e}"
            )),
            AttemptError::Removed(_)
            | AttemptError::BadTarget(_)
            | AttemptError::Malformed(_)
            | AttemptError::Answered { .. } => Health::Unchanged,
        }
    }

    /// The client's answer when this failure at destination `d` (base URL `url`) ends the
    /// request: the destination's own answer passed on, else a JSON error that names it and
    /// says why no other destination took the request.
    pub fn answer(self, d: usize, url: &str) -> Answer<A> {
        let status = self.status();
        let message = format!(
            "destination {d} ({url}) failed: {}; {}",
            self.message(),
            if self.retryable() {
                "no other destination could take the retry"
            } else {
                "not retried elsewhere (it may still be running there)"
            }
        );
        match self {
            AttemptError::Answered { answer, .. } => Answer::PassOn(answer),
            _ => Answer::Error(ErrorBody {
                status,
                kind: if status == StatusCode::GATEWAY_TIMEOUT {
                    "upstream_timeout"
                } else {
                    "upstream_error"
                },
                message,
            }),
        }
    }
}

/// The answer when no destination is up to take a request (`occupied` slots hold a backend).
pub(crate) fn no_destination(occupied: usize) -> ErrorBody {
    ErrorBody {
        status: StatusCode::SERVICE_UNAVAILABLE,
        kind: "no_destination",
        message: format!(
            "no destination is up (0 of {occupied} pass health checks); check the engines' /health"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type E = AttemptError<&'static str>;

    const LIMIT: Duration = Duration::from_secs(3);

    /// Every variant once, with whether it may be retried, its health consequence, and the
    /// client's answer at destination 1 (`http://b`).
    fn cases() -> Vec<(E, bool, Health, Answer<&'static str>)> {
        let err = |status, kind, message: &str| {
            Answer::Error(ErrorBody {
                status,
                kind,
                message: message.to_string(),
            })
        };
        let (bad, slow) = (StatusCode::BAD_GATEWAY, StatusCode::GATEWAY_TIMEOUT);
        let answered = |code: u16| E::Answered {
            status: StatusCode::from_u16(code).unwrap(),
            answer: "the engine's answer",
        };
        vec![
            (
                E::Removed("destination 1 was removed from the backends".into()),
                true,
                Health::Unchanged,
                err(bad, "upstream_error", "destination 1 (http://b) failed: destination 1 was removed from the backends; no other destination could take the retry"),
            ),
            (
                E::BadTarget("request target http://b/%: invalid".into()),
                false,
                Health::Unchanged,
                err(bad, "upstream_error", "destination 1 (http://b) failed: request target http://b/%: invalid; not retried elsewhere (it may still be running there)"),
            ),
            (
                E::Connection("connect to b: refused".into()),
                true,
                Health::Down("a request's connection failed: connect to b: refused".into()),
                err(bad, "upstream_error", "destination 1 (http://b) failed: connect to b: refused; no other destination could take the retry"),
            ),
            (
                E::Malformed("b: invalid HTTP version".into()),
                false,
                Health::Unchanged,
                err(bad, "upstream_error", "destination 1 (http://b) failed: b: invalid HTTP version; not retried elsewhere (it may still be running there)"),
            ),
            (
                E::NoResponse(LIMIT),
                false,
                Health::Slow,
                err(slow, "upstream_timeout", "destination 1 (http://b) failed: no response within 3s; not retried elsewhere (it may still be running there)"),
            ),
            (
                E::NoFirstByte(LIMIT),
                false,
                Health::Slow,
                err(slow, "upstream_timeout", "destination 1 (http://b) failed: no first body byte within 3s; not retried elsewhere (it may still be running there)"),
            ),
            (
                E::BodyBroke("reset".into()),
                false,
                Health::Broke("the response body broke before its first byte: reset".into()),
                err(bad, "upstream_error", "destination 1 (http://b) failed: response body broke before its first byte: reset; not retried elsewhere (it may still be running there)"),
            ),
            (answered(503), true, Health::Unchanged, Answer::PassOn("the engine's answer")),
            (answered(502), false, Health::Unchanged, Answer::PassOn("the engine's answer")),
            (answered(504), false, Health::Unchanged, Answer::PassOn("the engine's answer")),
        ]
    }

    #[test]
    fn only_attempts_that_cannot_be_running_are_retried() {
        for (e, retry, _, _) in cases() {
            assert_eq!(e.retryable(), retry, "{}", e.message());
        }
    }

    #[test]
    fn only_a_failed_connection_marks_the_destination_down() {
        for (e, _, health, _) in cases() {
            assert_eq!(e.health(), health, "{}", e.message());
        }
    }

    #[test]
    fn each_failure_maps_to_its_answer() {
        for (e, _, _, answer) in cases() {
            let what = e.message();
            assert_eq!(e.answer(1, "http://b"), answer, "{what}");
        }
    }

    #[test]
    fn no_destination_is_a_503_naming_the_count() {
        assert_eq!(
            no_destination(4),
            ErrorBody {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "no_destination",
                message:
                    "no destination is up (0 of 4 pass health checks); check the engines' /health"
                        .into(),
            }
        );
    }
}
