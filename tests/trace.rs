//! Trace propagation across the outbox, against the real PostgreSQL and RabbitMQ: the
//! enqueuing span, the relay's publish span and the consumer runner's handler span share
//! one trace. One test: the tracing subscriber is process-wide.
#![cfg(all(feature = "opentelemetry", feature = "rabbitmq"))]

mod common;

use common::Alone;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::broker::{SharedQueue, amqp_url};
use common::{DEADLINE, eventually, fixture, spawn_consumer, spawn_relay, stop_relay};
use diesel_outbox::consumer::{Consumer, handler_fn, rabbitmq};
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Message};
use opentelemetry::trace::{SpanId, TracerProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

fn find<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    spans.iter().find(|s| s.name == name).unwrap_or_else(|| {
        panic!(
            "no span {name} in {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        )
    })
}

#[tokio::test]
async fn enqueue_publish_and_handler_spans_share_one_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("diesel-outbox-test")));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    let mut f = fixture().await;
    let broker = SharedQueue::new().await;
    let outbox = f.outbox.clone();
    // The application's own span around the business transaction.
    async {
        outbox
            .enqueue_alone(
                &mut f.conn,
                Message::new("order.created", "x").key("traced"),
            )
            .await
    }
    .instrument(tracing::info_span!("place order"))
    .await
    .unwrap();
    // An enqueue outside any span carries no trace context.
    f.enqueue(Message::new("order.created", "x").key("untraced"))
        .await;

    let publisher = RabbitMqPublisher::builder(amqp_url(), &broker.exchange)
        .connect()
        .await
        .unwrap();
    let (stop, task) = spawn_relay(f.outbox.relay(f.pool.clone(), publisher).build().unwrap());
    let handled = Arc::new(AtomicUsize::new(0));
    let counted = handled.clone();
    let consumer = Consumer::builder(f.outbox.clone(), f.pool.clone(), "traced")
        .source(rabbitmq::Source::queue(amqp_url(), &broker.queue))
        .handler(handler_fn(move |_, _| {
            let counted = counted.clone();
            Box::pin(async move {
                tracing::info_span!("write invoice").in_scope(|| {
                    counted.fetch_add(1, Ordering::SeqCst);
                });
                Ok(())
            })
        }))
        .build()
        .unwrap();
    let (tx, consuming) = spawn_consumer(consumer);
    eventually(DEADLINE, "both messages handled", || async {
        (AtomicUsize::load(&handled, Ordering::SeqCst) == 2).then_some(())
    })
    .await;
    stop_relay(tx, consuming).await;
    stop_relay(stop, task).await;
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let enqueue = find(&spans, "place order");
    let trace = enqueue.span_context.trace_id();
    let of_trace: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect();
    let publish = of_trace
        .iter()
        .find(|s| s.name == "publish order.created")
        .expect("the publish span continues the enqueue's trace");
    assert_eq!(
        publish.parent_span_id,
        enqueue.span_context.span_id(),
        "child on the first attempt"
    );
    let process = of_trace
        .iter()
        .find(|s| s.name == "process order.created")
        .expect("the handler's span continues it too");
    assert_eq!(process.parent_span_id, enqueue.span_context.span_id());
    // The consumer's own name has an attribute of its own; RabbitMQ has no consumer groups,
    // so the span names none.
    let attribute = |span: &SpanData, key: &str| {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    };
    assert_eq!(
        attribute(process, "outbox.consumer.name").as_deref(),
        Some("traced")
    );
    assert_eq!(
        attribute(process, "messaging.consumer.group.name"),
        None,
        "{:?}",
        process.attributes
    );
    assert!(
        of_trace.iter().any(
            |s| s.name == "write invoice" && s.parent_span_id == process.span_context.span_id()
        ),
        "the handler's own spans nest under it"
    );
    // The untraced message's spans start traces of their own.
    let publishes = spans
        .iter()
        .filter(|s| s.name == "publish order.created")
        .count();
    assert_eq!(publishes, 2);
    assert!(
        spans
            .iter()
            .filter(|s| s.name == "publish order.created" && s.span_context.trace_id() != trace)
            .all(|s| s.parent_span_id == SpanId::INVALID),
        "no parent for the untraced message"
    );

    // A retry's publish span belongs with the enqueue's trace by a link, not as its child.
    let retried = async {
        outbox
            .enqueue_alone(
                &mut f.conn,
                Message::new("order.updated", "x").key("retried"),
            )
            .await
    }
    .instrument(tracing::info_span!("update order"))
    .await
    .unwrap();
    let failed_once = Arc::new(AtomicUsize::new(0));
    let publisher = {
        let failed_once = failed_once.clone();
        common::fakes::Recorder::default().failing(move |_| {
            (failed_once.fetch_add(1, Ordering::SeqCst) == 0)
                .then(|| diesel_outbox::PublishError::transient("a nack"))
        })
    };
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        .backoff(
            std::time::Duration::from_millis(20),
            std::time::Duration::from_millis(20),
        )
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay);
    f.wait_rows(
        &format!("idempotency_key = '{retried}' AND status = 'sent'"),
        1,
    )
    .await;
    stop_relay(stop, task).await;
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let update = find(&spans, "update order");
    let attempts: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == "publish order.updated")
        .collect();
    assert_eq!(attempts.len(), 2, "two attempts");
    let (first, retry): (Vec<&SpanData>, Vec<&SpanData>) = attempts
        .into_iter()
        .partition(|s| s.span_context.trace_id() == update.span_context.trace_id());
    assert_eq!(
        first.len(),
        1,
        "the first attempt is in the enqueue's trace"
    );
    assert_eq!(first[0].parent_span_id, update.span_context.span_id());
    assert_eq!(retry.len(), 1);
    assert!(
        retry[0]
            .links
            .links
            .iter()
            .any(|l| l.span_context.span_id() == update.span_context.span_id()),
        "the retry links to the enqueuing span"
    );

    // The trace headers are the crate's: a message may not set them.
    let err = f
        .outbox
        .enqueue_alone(
            &mut f.conn,
            Message::new("t", "x").header("traceparent", "00-x"),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
}
