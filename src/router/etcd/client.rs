//! etcd v3's JSON gateway (HTTP/1.1, base64 keys and values), spoken with the router's HTTP
//! client: get, range, put, leases, a create-if-absent and a compare-and-put transaction, and a
//! watch. Mechanism only: it knows nothing of plans or of the router.

use crate::router::json::{at, set};
use serde_json::{json, Value};
use std::io::BufRead;
use std::time::Duration;

/// One etcd call's limit (the watch has none: it streams).
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Standard base64 with padding (the gateway's encoding of `bytes` fields).
fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(s: &str) -> Result<Vec<u8>, String> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| format!("not base64 ({e})"))
}

/// A 64-bit field as the gateway writes it (a JSON string), 0 when absent.
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The end of the range of every key that starts with `p`.
fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut e = p.to_vec();
    while let Some(last) = e.last_mut() {
        if *last < 0xff {
            *last += 1;
            return e;
        }
        e.pop();
    }
    vec![0]
}

/// One key-value as etcd returns it.
#[derive(Debug, Clone)]
pub(crate) struct Kv {
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: i64,
}

fn kv(v: &Value) -> Option<Kv> {
    Some(Kv {
        value: unb64(v.get("value").and_then(Value::as_str).unwrap_or("")).ok()?,
        create_revision: int(at(v, "/create_revision")),
        mod_revision: int(at(v, "/mod_revision")),
        lease: int(at(v, "/lease")),
    })
    .filter(|_| v.get("key").is_some())
}

fn kvs(v: &Value) -> Vec<Kv> {
    at(v, "/kvs")
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(kv)
        .collect()
}

/// A blocking client of etcd's v3 JSON gateway (made and used off any async runtime).
pub(crate) struct Client {
    base: String,
    http: reqwest::blocking::Client,
}

impl Client {
    pub fn new(endpoint: &str, timeout: Option<Duration>) -> Result<Self, String> {
        let http = reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(1))
            .timeout(timeout)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("etcd client: {}", crate::error_chain(&e)))?;
        Ok(Self {
            base: format!("{}/v3", endpoint.trim_end_matches('/')),
            http,
        })
    }

    fn post(&self, path: &str, body: &Value) -> Result<reqwest::blocking::Response, String> {
        let r = self
            .http
            .post(format!("{}/{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .map_err(|e| format!("etcd {}/{path}: {}", self.base, crate::error_chain(&e)))?;
        if r.status().is_success() {
            return Ok(r);
        }
        let status = r.status();
        let text: String = r.text().unwrap_or_default().chars().take(300).collect();
        Err(format!("etcd {}/{path}: HTTP {status}: {text}", self.base))
    }

    fn call(&self, path: &str, body: Value) -> Result<Value, String> {
        let text = self
            .post(path, &body)?
            .text()
            .map_err(|e| format!("etcd {}/{path}: {}", self.base, crate::error_chain(&e)))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| format!("etcd {}/{path}: not JSON ({e})", self.base))?;
        match v.get("error") {
            Some(e) => Err(format!("etcd {}/{path}: {e}", self.base)),
            None => Ok(v),
        }
    }

    /// `key`'s value (if any) and the store's revision.
    pub fn get(&self, key: &str) -> Result<(Option<Kv>, i64), String> {
        let v = self.call("kv/range", json!({"key": b64(key.as_bytes())}))?;
        Ok((kvs(&v).into_iter().next(), int(at(&v, "/header/revision"))))
    }

    /// Every key under `prefix`.
    pub fn get_prefix(&self, prefix: &str) -> Result<Vec<Kv>, String> {
        let p = prefix.as_bytes();
        let v = self.call(
            "kv/range",
            json!({"key": b64(p), "range_end": b64(&prefix_end(p))}),
        )?;
        Ok(kvs(&v))
    }

    /// Put `key` = `value` (under `lease` when not 0); the store's new revision.
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<i64, String> {
        let mut b = json!({"key": b64(key.as_bytes()), "value": b64(value)});
        if lease != 0 {
            set(&mut b, "lease", json!(lease.to_string()));
        }
        Ok(int(at(&self.call("kv/put", b)?, "/header/revision")))
    }

    /// A lease of `ttl_s` seconds: its id.
    pub fn grant(&self, ttl_s: u64) -> Result<i64, String> {
        let v = self.call("lease/grant", json!({"TTL": ttl_s.to_string()}))?;
        match int(at(&v, "/ID")) {
            0 => Err(format!("etcd lease/grant: no lease in {v}")),
            id => Ok(id),
        }
    }

    /// Renew lease `id`: its TTL now (0: the lease is gone).
    pub fn keepalive(&self, id: i64) -> Result<i64, String> {
        let v = self.call("lease/keepalive", json!({"ID": id.to_string()}))?;
        Ok(int(at(&v, "/result/TTL")))
    }

    pub fn revoke(&self, id: i64) -> Result<(), String> {
        self.call("lease/revoke", json!({"ID": id.to_string()}))
            .map(|_| ())
    }

    /// Create `key` = `value` under `lease` where `key` does not exist: `Ok(Ok(its create
    /// revision))` when this call created it, `Ok(Err(what holds it))` otherwise.
    pub fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
    ) -> Result<Result<i64, Option<Kv>>, String> {
        let k = b64(key.as_bytes());
        let v = self.call(
            "kv/txn",
            json!({
                "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": k, "value": b64(value), "lease": lease.to_string()}}],
                "failure": [{"request_range": {"key": k}}],
            }),
        )?;
        if at(&v, "/succeeded").as_bool() == Some(true) {
            return Ok(Ok(int(at(&v, "/header/revision"))));
        }
        Ok(Err(kvs(at(&v, "/responses/0/response_range"))
            .into_iter()
            .next()))
    }

    /// Put `key` = `value` only while `guard`'s create revision is `created` (the replica
    /// that created it still holds it): the put's revision, or `None`.
    pub fn put_if(
        &self,
        guard: &str,
        created: i64,
        key: &str,
        value: &[u8],
    ) -> Result<Option<i64>, String> {
        let v = self.call(
            "kv/txn",
            json!({
                "compare": [{"key": b64(guard.as_bytes()), "target": "CREATE", "result": "EQUAL",
                             "create_revision": created.to_string()}],
                "success": [{"request_put": {"key": b64(key.as_bytes()), "value": b64(value)}}],
            }),
        )?;
        Ok((at(&v, "/succeeded").as_bool() == Some(true)).then(|| int(at(&v, "/header/revision"))))
    }

    /// Watch `key` from revision `start`: every value put, to `on_put`, until the stream ends
    /// or fails.
    pub fn watch(&self, key: &str, start: i64, mut on_put: impl FnMut(Kv)) -> Result<(), String> {
        let r = self.post(
            "watch",
            &json!({"create_request": {"key": b64(key.as_bytes()), "start_revision": start.to_string()}}),
        )?;
        for line in std::io::BufReader::new(r).lines() {
            let line = line.map_err(|e| format!("etcd watch: {e}"))?;
            if line.trim().is_empty() {
                continue;
            }
            let v: Value =
                serde_json::from_str(&line).map_err(|e| format!("etcd watch: not JSON ({e})"))?;
            if let Some(e) = v.get("error") {
                return Err(format!("etcd watch: {e}"));
            }
            let res = at(&v, "/result");
            if at(res, "/canceled").as_bool() == Some(true) {
                return Err(format!(
                    "etcd watch canceled: {}",
                    at(res, "/cancel_reason")
                ));
            }
            for e in at(res, "/events").as_array().into_iter().flatten() {
                if at(e, "/type").as_str() == Some("DELETE") {
                    continue;
                }
                if let Some(kv) = kv(at(e, "/kv")) {
                    on_put(kv);
                }
            }
        }
        Ok(())
    }
}

/// Put `key` = `value` into the etcd at `endpoint` (http://HOST:PORT): the store's new
/// revision. For tools and tests that write a key by hand (the router itself writes through
/// its threads). Blocking: call it off any async runtime.
pub fn etcd_put(endpoint: &str, key: &str, value: &[u8]) -> Result<i64, String> {
    Client::new(endpoint, Some(CALL_TIMEOUT))?.put(key, value, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_the_standard_alphabet() {
        assert_eq!(b64(b"/x/plan"), "L3gvcGxhbg==");
        assert_eq!(b64(b"hi"), "aGk=");
        assert_eq!(b64(b"abc"), "YWJj");
        assert_eq!(b64(b""), "");
        for n in 0..300usize {
            let v: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
            assert_eq!(unb64(&b64(&v)).unwrap(), v, "{n} bytes");
        }
        assert!(unb64("a*b").is_err());
    }

    #[test]
    fn the_prefix_range_ends_after_every_key_under_it() {
        assert_eq!(prefix_end(b"/p/rates/"), b"/p/rates0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
