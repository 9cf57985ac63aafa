//! A raw gRPC caller for the EPP's `Process` and health methods (hyper's HTTP/2 client, the
//! messages of `cacheroute::router::epp::proto`), for the tests that speak to it without Envoy.

use bytes::{BufMut, Bytes, BytesMut};
use cacheroute::router::epp::{proto, PROCESS};
use http_body_util::{BodyExt, Full};
use prost::Message;

/// One gRPC message frame.
pub fn grpc_frame(payload: &[u8]) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(0);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// Call `Process` with `body` (gRPC frames) on the EPP at `addr`: (response messages' bytes,
/// grpc-status).
pub async fn call(addr: &str, body: Bytes) -> (Bytes, String) {
    call_method(addr, PROCESS, body).await
}

/// Call gRPC method `path` with `body` on the EPP at `addr`: (response bytes, grpc-status).
pub async fn call_method(addr: &str, path: &str, body: Bytes) -> (Bytes, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(body))
        .unwrap();
    let resp = tx.send_request(req).await.unwrap();
    answer(resp.into_body().collect().await.unwrap())
}

/// A collected gRPC answer: (its messages' bytes, grpc-status; empty without one).
pub fn answer(got: http_body_util::Collected<Bytes>) -> (Bytes, String) {
    let status = got
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (got.to_bytes(), status)
}

/// A header as Envoy sends it (the value in `raw_value`).
pub fn header(key: &str, value: &str) -> proto::HeaderValue {
    proto::HeaderValue {
        key: key.into(),
        value: String::new(),
        raw_value: value.as_bytes().to_vec(),
    }
}

/// A `ProcessingRequest` holding `r`, framed.
pub fn message(r: proto::processing_request::Request) -> Bytes {
    grpc_frame(
        &proto::ProcessingRequest {
            request: Some(r),
            metadata_context: None,
            observability_mode: false,
        }
        .encode_to_vec(),
    )
}

/// One whole request over `Process` at `addr`: headers (`key` in `x-cacheroute-key`), then
/// `body`; the endpoint picked (`IP:PORT`), or the immediate response's status.
pub async fn pick(addr: &str, key: &str, body: &str) -> Result<String, i32> {
    use proto::processing_request::Request as In;
    use proto::processing_response::Response as Out;
    let mut frames = BytesMut::new();
    frames.extend_from_slice(&message(In::RequestHeaders(proto::HttpHeaders {
        headers: Some(proto::HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
                header("x-cacheroute-key", key),
            ],
        }),
        end_of_stream: false,
    })));
    frames.extend_from_slice(&message(In::RequestBody(proto::HttpBody {
        body: Bytes::from(body.to_string()),
        end_of_stream: true,
    })));
    let (mut out, status) = call(addr, frames.freeze()).await;
    assert_eq!(status, "0");
    let mut last = None;
    while out.len() >= 5 {
        let len = u32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
        let m = out.split_to(5 + len);
        last = Some(proto::ProcessingResponse::decode(&m[5..]).unwrap());
    }
    match last.and_then(|r| r.response) {
        Some(Out::RequestBody(b)) => {
            let h = b.response.unwrap().header_mutation.unwrap().set_headers[0]
                .header
                .clone()
                .unwrap();
            Ok(String::from_utf8(h.raw_value).unwrap())
        }
        Some(Out::ImmediateResponse(i)) => Err(i.status.unwrap().code),
        other => panic!("no answer to the body: {other:?}"),
    }
}

/// The `ProcessingResponse`s in a `Process` answer's bytes.
pub fn answers(mut out: Bytes) -> Vec<proto::ProcessingResponse> {
    let mut all = Vec::new();
    while out.len() >= 5 {
        let len = u32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
        let m = out.split_to(5 + len);
        all.push(proto::ProcessingResponse::decode(&m[5..]).unwrap());
    }
    all
}
