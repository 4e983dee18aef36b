//! W3C Trace Context: the `traceparent` (and `tracestate`) of an inbound callback or a
//! hand-off is kept with its message and sent with each delivery, so a trace that starts at
//! the provider or the connector continues at the receiver, days of retries later.
//!
//! Each attempt is a new span of the same trace: the trace id and flags are kept, the
//! parent id is new per attempt. An invalid `traceparent` is dropped, as the spec says.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, HeaderValue};

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// The spec's limit on `tracestate` (32 members of at most 256 characters would be more;
/// 512 is what it asks vendors to propagate at least).
const MAX_TRACESTATE: usize = 512;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: String,
    pub parent_id: String,
    pub flags: String,
}

fn lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl TraceParent {
    /// Parses a `traceparent` value (version 00, or a later version read as 00).
    pub fn parse(value: &str) -> Option<TraceParent> {
        let value = value.trim();
        let version = value.get(..2)?;
        if !lower_hex(version, 2) || version == "ff" {
            return None;
        }
        // Version 00 is exactly 55 characters; later versions may append `-...` fields.
        if value.len() < 55 || (version == "00" && value.len() != 55) {
            return None;
        }
        if value.len() > 55 && value.as_bytes()[55] != b'-' {
            return None;
        }
        let mut parts = value[..55].split('-');
        let (_, trace_id, parent_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let valid = lower_hex(trace_id, 32)
            && lower_hex(parent_id, 16)
            && lower_hex(flags, 2)
            && trace_id.bytes().any(|b| b != b'0')
            && parent_id.bytes().any(|b| b != b'0');
        valid.then(|| TraceParent {
            trace_id: trace_id.to_string(),
            parent_id: parent_id.to_string(),
            flags: flags.to_string(),
        })
    }

    /// A new span of the same trace.
    pub fn child(&self) -> TraceParent {
        let span = rand::random::<u64>().max(1);
        TraceParent {
            trace_id: self.trace_id.clone(),
            parent_id: format!("{span:016x}"),
            flags: self.flags.clone(),
        }
    }

    pub fn header(&self) -> String {
        format!("00-{}-{}-{}", self.trace_id, self.parent_id, self.flags)
    }
}

/// Puts the request's trace context (else a valid one already among a hand-off's `headers`)
/// into the headers stored with a message; an invalid one is dropped.
pub fn carry(request: &HeaderMap, stored: &mut BTreeMap<String, String>) {
    let named = |map: &BTreeMap<String, String>, name: &str| {
        map.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let from_request = request
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let (parent, state) = match from_request {
        Some(p) => (
            Some(p),
            request
                .get(TRACESTATE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
        ),
        None => (
            named(stored, TRACEPARENT).and_then(|v| TraceParent::parse(&v)),
            named(stored, TRACESTATE),
        ),
    };
    stored
        .retain(|k, _| !k.eq_ignore_ascii_case(TRACEPARENT) && !k.eq_ignore_ascii_case(TRACESTATE));
    if let Some(parent) = parent {
        stored.insert(TRACEPARENT.into(), parent.header());
        if let Some(state) = state.filter(|s| s.len() <= MAX_TRACESTATE && !s.trim().is_empty()) {
            stored.insert(TRACESTATE.into(), state);
        }
    }
}

/// Makes the stored `traceparent` of an attempt's headers a new span of its trace.
pub fn new_span(headers: &mut HeaderMap) {
    let parent = headers
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    match parent.and_then(|p| HeaderValue::from_str(&p.child().header()).ok()) {
        Some(value) => {
            headers.insert(TRACEPARENT, value);
        }
        None => {
            headers.remove(TRACEPARENT);
            headers.remove(TRACESTATE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_specs_forms() {
        let p = TraceParent::parse(VALID).unwrap();
        assert_eq!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.header(), VALID);
        assert!(
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later")
                .is_some()
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "not a trace",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_flags() {
        let p = TraceParent::parse(VALID).unwrap();
        let c = p.child();
        assert_eq!(
            (c.trace_id.as_str(), c.flags.as_str()),
            (p.trace_id.as_str(), "01")
        );
        assert_ne!(c.parent_id, p.parent_id);
        assert!(TraceParent::parse(&c.header()).is_some());
    }

    #[test]
    fn carry_prefers_the_request_and_drops_invalid_values() {
        let mut request = HeaderMap::new();
        request.insert(TRACEPARENT, VALID.parse().unwrap());
        request.insert(TRACESTATE, "vendor=1".parse().unwrap());
        let mut stored = BTreeMap::from([
            ("Traceparent".to_string(), "junk".to_string()),
            ("X-App".to_string(), "k".to_string()),
        ]);
        carry(&request, &mut stored);
        assert_eq!(stored[TRACEPARENT], VALID);
        assert_eq!(stored[TRACESTATE], "vendor=1");
        assert_eq!(stored.len(), 3);

        let mut only_junk = BTreeMap::from([(TRACEPARENT.to_string(), "junk".to_string())]);
        carry(&HeaderMap::new(), &mut only_junk);
        assert!(only_junk.is_empty());
    }
}
