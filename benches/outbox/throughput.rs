//! (a) Relay throughput against raw lapin publishing the same messages, with the CPU of
//! each process; (a′) the relay's PostgreSQL CPU per message against a bare claim +
//! mark-sent loop over as many rows, and against a plain read of as many rows (the floor:
//! what reading them once costs PostgreSQL, with no bookkeeping at all); (a″) the relay
//! process's CPU per message against raw lapin's; (g) the relay's peak memory.

use std::time::Instant;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Bytea, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::ConfirmSelectOptions;
use serde_json::json;

use crate::fixture::{Env, Keys, raw_publish};
use crate::measure::{CLIENT, EXTRA, POSTGRES};
use crate::{BoxResult, Figure, KIB};

pub(crate) async fn throughput(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = env.scale(50_000, 10_000);
    let naive_n = env.scale(3_000, 1_000);
    let batch: usize = std::env::var("BENCH_BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(512);
    let (exchange, queue) = env.queue("throughput").await?;
    let payload = vec![b'x'; KIB];

    // Each arm starts right after a checkpoint, so none pays for earlier writes.
    env.conn.batch_execute("CHECKPOINT").await?;
    // Baseline: raw lapin, confirms, up to `window` in flight.
    let window = 512;
    let raw_channel = env.amqp.create_channel().await?;
    raw_channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let started = Instant::now();
    let raw_cpu_window = env.cpu(None);
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
        if in_flight.len() >= window {
            in_flight.next().await.expect("a confirm")?;
        }
        in_flight.push(raw_publish(&raw_channel, &exchange, &payload, format!("raw{i}")).await?);
    }
    while let Some(confirm) = in_flight.next().await {
        confirm?;
    }
    let raw_rate = n as f64 / started.elapsed().as_secs_f64();
    let raw_cpu = raw_cpu_window.used(n);
    env.purge(&queue).await?;

    // The relay, as its own process (the operator binary), so its memory can be read.
    let outbox = env.outbox("throughput").await?;
    let batch_arg = batch.to_string();
    let relay = env
        .drain_by_relay_process(
            &outbox,
            &["--exchange", &exchange, "--batch-size", &batch_arg],
            &[("AMQP_URL", &env.amqp_url.clone())],
            n,
            Keys::Unordered,
        )
        .await?;
    env.purge(&queue).await?;

    // The bare loop: claim a batch and mark it sent, over as many rows, no broker.
    // On the per-row engine whatever is measured: it is the per-row bookkeeping's floor.
    let bare = env.outbox_on("bare", diesel_outbox::Engine::PerRow).await?;
    env.fill(&bare, n, Keys::Unordered).await?;
    env.conn.batch_execute("CHECKPOINT").await?;
    let bare_claim = format!(
        "WITH picked AS MATERIALIZED (SELECT id FROM {t} WHERE status = 'pending' \
         AND (lease_until IS NULL OR lease_until < now()) AND id > $1 ORDER BY id \
         LIMIT {batch} FOR UPDATE SKIP LOCKED) \
         UPDATE {t} SET lease_until = now() + interval '30 seconds', attempts = attempts + 1, \
         fencing_token = fencing_token + 1 FROM picked WHERE {t}.id = picked.id \
         RETURNING {t}.id, {t}.idempotency_key AS key, {t}.payload",
        t = bare.table()
    );
    let bare_mark = format!(
        "UPDATE {} SET status = 'sent', sent_at = now(), lease_until = NULL WHERE id = ANY($1)",
        bare.table()
    );
    let mut bare_conn = diesel_outbox::establish(&env.database_url).await?;
    // The plan guidance the relay's statements run with: on a table whose statistics do not
    // yet know the backlog, the planner would read and sort every pending row per claim.
    bare_conn
        .batch_execute("SET enable_seqscan = off; SET enable_bitmapscan = off")
        .await?;
    let started = Instant::now();
    let bare_window = env.cpu(None);
    let mut marked = 0;
    // A cursor past the rows already done, so no claim walks over their index entries.
    let mut last = 0i64;
    loop {
        let rows: Vec<Row> = diesel::sql_query(&bare_claim)
            .bind::<BigInt, _>(last)
            .load(&mut bare_conn)
            .await?;
        if rows.is_empty() {
            break;
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        last = ids.iter().copied().max().unwrap_or(last);
        marked += diesel::sql_query(&bare_mark)
            .bind::<diesel::sql_types::Array<BigInt>, _>(&ids)
            .execute(&mut bare_conn)
            .await?;
    }
    assert_eq!(marked, n);
    let bare_rate = n as f64 / started.elapsed().as_secs_f64();
    let bare_cpu = bare_window.used(n);

    // The floor: as many fresh rows on the engine measured, read once in id order through a
    // cursor, in pages of the batch size, in one transaction. No lease, no cursor row, no
    // outcome: what any relay must pay PostgreSQL to get the rows out.
    let floor = env.outbox("floor").await?;
    env.fill(&floor, n, Keys::Unordered).await?;
    env.conn.batch_execute("CHECKPOINT").await?;
    let mut floor_conn = diesel_outbox::establish(&env.database_url).await?;
    let floor_window = env.cpu(None);
    floor_conn
        .batch_execute(&format!(
            "BEGIN; DECLARE floor NO SCROLL CURSOR FOR SELECT id, idempotency_key AS key, \
             topic, aggregate_key, payload, content_type, headers, attempts \
             FROM {} ORDER BY id",
            floor.table()
        ))
        .await?;
    let mut read = 0;
    loop {
        let rows: Vec<Row> = diesel::sql_query(format!("FETCH {batch} FROM floor"))
            .load(&mut floor_conn)
            .await?;
        if rows.is_empty() {
            break;
        }
        read += rows.len();
    }
    floor_conn.batch_execute("COMMIT").await?;
    assert_eq!(read, n);
    let floor_cpu = floor_window.used(n);

    // The naive relay: claim one row, publish, await the confirm, mark it sent.
    let naive = env
        .outbox_on("naive", diesel_outbox::Engine::PerRow)
        .await?;
    env.fill(&naive, naive_n, Keys::Unordered).await?;
    let naive_channel = env.amqp.create_channel().await?;
    naive_channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut conn = diesel_outbox::establish(&env.database_url).await?;
    let claim = format!(
        "UPDATE {t} SET lease_until = now() + interval '30 seconds', attempts = attempts + 1 \
         WHERE id = (SELECT id FROM {t} WHERE status = 'pending' \
         AND (lease_until IS NULL OR lease_until < now()) ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) \
         RETURNING id, idempotency_key AS key, payload",
        t = naive.table()
    );
    let mark = format!(
        "UPDATE {} SET status = 'sent', sent_at = now() WHERE id = $1",
        naive.table()
    );
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Bytea)]
        payload: Vec<u8>,
    }
    let started = Instant::now();
    let mut sent = 0;
    while let Some(row) = diesel::sql_query(&claim)
        .get_result::<Row>(&mut conn)
        .await
        .map(Some)
        .or_else(|e| match e {
            diesel::result::Error::NotFound => Ok(None),
            e => Err(e),
        })?
    {
        raw_publish(&naive_channel, &exchange, &row.payload, row.key)
            .await?
            .await?;
        diesel::sql_query(&mark)
            .bind::<BigInt, _>(row.id)
            .execute(&mut conn)
            .await?;
        sent += 1;
    }
    assert_eq!(sent, naive_n);
    let naive_rate = naive_n as f64 / started.elapsed().as_secs_f64();
    env.drop_queue(&queue).await?;

    let params = json!({ "messages": n, "payload_bytes": KIB, "batch_size": batch, "raw_window": window, "naive_messages": naive_n, "relay": "diesel-outbox relay process", "cpu_raw": raw_cpu.json(), "cpu_relay": relay.cpu.json(), "cpu_bare_loop": bare_cpu.json(), "cpu_plain_read": floor_cpu.json(), "bare_loop_rows_per_s": crate::round(bare_rate) });
    let figures = vec![
        Figure {
            name: "a. relay vs raw lapin",
            value: relay.rate,
            unit: "msg/s",
            baseline: Some(("raw lapin, pipelined confirms", raw_rate)),
            target: ">= 0.90 x",
            params: params.clone(),
        },
        Figure {
            name: "a. relay vs naive relay",
            value: relay.rate,
            unit: "msg/s",
            baseline: Some(("naive relay", naive_rate)),
            target: ">= 10 x",
            params: params.clone(),
        },
        Figure {
            name: "a′. relay's PostgreSQL CPU per message",
            value: relay.cpu.us[POSTGRES],
            unit: "µs",
            baseline: Some((
                "bare claim + mark-sent loop, per row",
                bare_cpu.us[POSTGRES],
            )),
            target: match env.engine {
                diesel_outbox::Engine::Log => "<= 0.35 x",
                _ => "<= 1.30 x",
            },
            params: params.clone(),
        },
        Figure {
            name: "a′. relay's PostgreSQL CPU per message vs a plain read",
            value: relay.cpu.us[POSTGRES],
            unit: "µs",
            baseline: Some((
                "a plain cursor read of as many rows, per row (the floor)",
                floor_cpu.us[POSTGRES],
            )),
            target: "(the floor)",
            params: params.clone(),
        },
        Figure {
            name: "a″. relay process CPU per message",
            value: relay.cpu.us[EXTRA],
            unit: "µs",
            baseline: Some(("raw lapin client, per message", raw_cpu.us[CLIENT])),
            target: "<= 1.20 x",
            params: params.clone(),
        },
        Figure {
            name: "g. relay peak RSS",
            value: relay
                .peak_rss_kib
                .ok_or("the relay's peak memory is unreadable")? as f64
                / 1024.0,
            unit: "MiB",
            baseline: None,
            target: "<= 64 MiB",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}
