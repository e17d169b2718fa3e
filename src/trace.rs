//! Trace propagation across the outbox (feature `opentelemetry`): the W3C `traceparent`
//! and `tracestate` of the enqueuing span are stored with the row as headers, the relay's
//! publish span continues that trace, every publisher sends the headers with the message,
//! and the consumer runner's handler span continues it again.
//!
//! The context is read from the current `tracing` span through tracing-opentelemetry, or,
//! failing that, from OpenTelemetry's current context. Without the feature nothing is
//! captured; the two header names are reserved either way.

/// The W3C trace-context header names, which messages may not set themselves.
pub(crate) const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

#[cfg(feature = "opentelemetry")]
mod otel {
    use std::collections::BTreeMap;

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// The current span's context as trace headers; none when there is no valid context.
    pub(crate) fn current() -> Vec<(String, String)> {
        let mut cx = tracing::Span::current().context();
        if !cx.span().span_context().is_valid() {
            cx = opentelemetry::Context::current();
        }
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return Vec::new();
        }
        let mut headers = vec![(
            "traceparent".to_owned(),
            format!(
                "00-{:032x}-{:016x}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            ),
        )];
        let state = sc.trace_state().header();
        if !state.is_empty() {
            headers.push(("tracestate".to_owned(), state));
        }
        headers
    }

    /// Lowercase hex of exactly `len` digits.
    fn hex(field: &str, len: usize) -> bool {
        field.len() == len
            && field
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }

    /// The remote span context `headers` carry, if their `traceparent` is valid by the W3C
    /// rules: version `00` with exactly four fields, or a later version (not `ff`) whose
    /// first four fields are read and the rest ignored.
    pub(crate) fn remote(headers: &BTreeMap<String, String>) -> Option<SpanContext> {
        let parent = headers.get("traceparent")?;
        let mut parts = parent.split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let extra = parts.next().is_some();
        if !hex(version, 2) || version == "ff" || (version == "00" && extra) {
            return None;
        }
        if !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        let state = headers
            .get("tracestate")
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let sc = SpanContext::new(
            TraceId::from_hex(trace).ok()?,
            SpanId::from_hex(span).ok()?,
            TraceFlags::new(flags),
            true,
            state,
        );
        sc.is_valid().then_some(sc)
    }

    /// Makes `span` continue the trace of `headers`: its child when `child`, else linked to
    /// it (a retry is not a child of the enqueue, but belongs with it).
    pub(crate) fn continue_in(
        span: &tracing::Span,
        headers: &BTreeMap<String, String>,
        child: bool,
    ) {
        let Some(remote) = remote(headers) else {
            return;
        };
        if child {
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
        } else {
            span.add_link(remote);
        }
    }
}

#[cfg(feature = "opentelemetry")]
pub(crate) use otel::{continue_in, current};

/// Without the feature: nothing to capture.
#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn current() -> Vec<(String, String)> {
    Vec::new()
}

/// Without the feature: nothing to continue.
#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn continue_in(
    _span: &tracing::Span,
    _headers: &std::collections::BTreeMap<String, String>,
    _child: bool,
) {
}

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use std::collections::BTreeMap;

    use super::otel::remote;

    #[test]
    fn a_traceparent_is_read_back_and_a_malformed_one_is_ignored() {
        let headers = |parent: &str| {
            BTreeMap::from([
                ("traceparent".to_owned(), parent.to_owned()),
                ("tracestate".to_owned(), "vendor=1".to_owned()),
            ])
        };
        let sc = remote(&headers(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ))
        .expect("valid");
        assert_eq!(
            format!("{:032x}", sc.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(format!("{:016x}", sc.span_id()), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        assert!(
            remote(&headers(
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more"
            ))
            .is_some(),
            "a later version is read leniently"
        );
        assert_eq!(sc.trace_state().header(), "vendor=1");
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-xyz-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(remote(&headers(bad)).is_none(), "{bad:?}");
        }
    }
}
