//! The protobuf messages the EPP reads and writes, written by hand with prost's derive: the
//! subset of `envoy.service.ext_proc.v3` (external_processor.proto), `envoy.config.core.v3`
//! (HeaderValue, HeaderMap, HeaderValueOption, Metadata), `envoy.type.v3.HttpStatus`,
//! `google.protobuf.Struct` and `grpc.health.v1` that it uses, with the field numbers of those
//! `.proto` files. Fields left out are skipped when decoding (protobuf's rule for unknown
//! fields), so newer Envoys that send more still decode.

use std::collections::HashMap;

/// `envoy.service.ext_proc.v3.ProcessingRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "processing_request::Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<processing_request::Request>,
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    #[prost(bool, tag = "10")]
    pub observability_mode: bool,
}

pub mod processing_request {
    /// The `request` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "2")]
        RequestHeaders(super::HttpHeaders),
        #[prost(message, tag = "3")]
        ResponseHeaders(super::HttpHeaders),
        #[prost(message, tag = "4")]
        RequestBody(super::HttpBody),
        #[prost(message, tag = "5")]
        ResponseBody(super::HttpBody),
        #[prost(message, tag = "6")]
        RequestTrailers(super::HttpTrailers),
        #[prost(message, tag = "7")]
        ResponseTrailers(super::HttpTrailers),
    }
}

/// `envoy.service.ext_proc.v3.HttpHeaders`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.HttpBody`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.HttpTrailers`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

/// `envoy.config.core.v3.HeaderMap`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `envoy.config.core.v3.HeaderValue`: Envoy sends the value in `raw_value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

/// `envoy.config.core.v3.Metadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metadata {
    #[prost(map = "string, message", tag = "1")]
    pub filter_metadata: HashMap<String, Struct>,
}

/// `google.protobuf.Struct`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Struct {
    #[prost(map = "string, message", tag = "1")]
    pub fields: HashMap<String, Value>,
}

/// `google.protobuf.Value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(oneof = "value::Kind", tags = "1, 2, 3, 4, 5, 6")]
    pub kind: Option<value::Kind>,
}

pub mod value {
    /// The `kind` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(int32, tag = "1")]
        NullValue(i32),
        #[prost(double, tag = "2")]
        NumberValue(f64),
        #[prost(string, tag = "3")]
        StringValue(String),
        #[prost(bool, tag = "4")]
        BoolValue(bool),
        #[prost(message, tag = "5")]
        StructValue(super::Struct),
        #[prost(message, tag = "6")]
        ListValue(super::ListValue),
    }
}

/// `google.protobuf.ListValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListValue {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<Value>,
}

/// `envoy.service.ext_proc.v3.ProcessingResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "processing_response::Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<processing_response::Response>,
    #[prost(message, optional, tag = "8")]
    pub dynamic_metadata: Option<Struct>,
}

pub mod processing_response {
    /// The `response` oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        RequestHeaders(super::HeadersResponse),
        #[prost(message, tag = "2")]
        ResponseHeaders(super::HeadersResponse),
        #[prost(message, tag = "3")]
        RequestBody(super::BodyResponse),
        #[prost(message, tag = "4")]
        ResponseBody(super::BodyResponse),
        #[prost(message, tag = "5")]
        RequestTrailers(super::TrailersResponse),
        #[prost(message, tag = "6")]
        ResponseTrailers(super::TrailersResponse),
        #[prost(message, tag = "7")]
        ImmediateResponse(super::ImmediateResponse),
    }
}

/// `envoy.service.ext_proc.v3.HeadersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `envoy.service.ext_proc.v3.BodyResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `envoy.service.ext_proc.v3.TrailersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

/// `envoy.service.ext_proc.v3.CommonResponse` (status 0 = CONTINUE).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

/// `envoy.service.ext_proc.v3.HeaderMutation`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
    #[prost(string, repeated, tag = "2")]
    pub remove_headers: Vec<String>,
}

/// `envoy.config.core.v3.HeaderValueOption`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    /// `HeaderAppendAction`: 2 = OVERWRITE_IF_EXISTS_OR_ADD.
    #[prost(int32, tag = "3")]
    pub append_action: i32,
}

/// `HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD`.
pub const OVERWRITE_IF_EXISTS_OR_ADD: i32 = 2;

/// `envoy.service.ext_proc.v3.ImmediateResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
    #[prost(string, tag = "5")]
    pub details: String,
}

/// `envoy.type.v3.HttpStatus` (the code is the HTTP status number).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    pub service: String,
}

/// `grpc.health.v1.HealthCheckResponse` (status 1 = SERVING, 2 = NOT_SERVING).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// A header to set (overwriting), its value in `raw_value` as Envoy expects.
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: OVERWRITE_IF_EXISTS_OR_ADD,
    }
}

/// A string `Value`.
pub fn string_value(s: String) -> Value {
    Value {
        kind: Some(value::Kind::StringValue(s)),
    }
}

/// A `Struct` `{namespace: {key: value}}` (dynamic metadata).
pub fn namespaced(namespace: &str, key: &str, value: String) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(key.to_string(), string_value(value))]),
    };
    Struct {
        fields: HashMap::from([(
            namespace.to_string(),
            Value {
                kind: Some(value::Kind::StructValue(inner)),
            },
        )]),
    }
}
