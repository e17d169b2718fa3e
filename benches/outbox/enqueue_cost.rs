//! (b) What an enqueue adds to the writer's transaction, against a no-op statement.

use std::time::Instant;

use diesel::IntoSql;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::Message;
use serde_json::json;

use crate::fixture::Env;
use crate::measure::{mean, percentile};
use crate::{BoxResult, Figure, KIB, round};

diesel::table! {
    /// The business table of (b): found through the search path, so Diesel's query builder
    /// (and its statement cache) serves the insert as an application's would.
    orders_b (id) {
        /// Identity.
        id -> BigInt,
        /// Who ordered.
        customer -> Text,
        /// How much.
        total -> Integer,
    }
}

pub(crate) async fn enqueue_cost(env: &mut Env) -> BoxResult<Vec<Figure>> {
    use diesel::ExpressionMethods;

    let rounds = env.scale(10, 4);
    let per_round = env.scale(300, 150);
    let outbox = env.outbox("enqueue_cost").await?;
    env.conn
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {schema}.orders_b; CREATE TABLE {schema}.orders_b (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             customer text NOT NULL, total int NOT NULL); SET search_path TO {schema}",
            schema = env.schema
        ))
        .await?;
    let insert = || {
        diesel::insert_into(orders_b::table)
            .values((orders_b::customer.eq("ada"), orders_b::total.eq(42)))
    };
    let message = || Message::new("order.created", vec![b'x'; KIB]);
    // What the transaction holds besides the business insert.
    #[derive(Clone, Copy)]
    enum Extra {
        Nothing,
        Enqueue,
        /// The enqueue pipelined with the business insert.
        Pipelined,
        /// One more statement that does nothing: the floor of any extra statement.
        Select,
        /// A second business insert: what any one-row insert costs (its row, its index
        /// entries and their WAL) on top of its round trip.
        Insert,
    }
    let arms = [
        Extra::Nothing,
        Extra::Enqueue,
        Extra::Pipelined,
        Extra::Select,
        Extra::Insert,
    ];
    let mut took: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
    // Interleaved rounds, so drift on a noisy machine hits every arm alike.
    for round in 0..rounds {
        for k in 0..arms.len() {
            let arm = (round + k) % arms.len();
            let extra = arms[arm];
            for _ in 0..per_round {
                let started = Instant::now();
                let outbox = outbox.clone();
                env.conn
                    .transaction(async |c| {
                        match extra {
                            Extra::Nothing => {
                                insert().execute(c).await?;
                            }
                            Extra::Enqueue => {
                                insert().execute(c).await?;
                                outbox.enqueue(c, message()).await?;
                            }
                            Extra::Pipelined => {
                                let c: &AsyncPgConnection = c;
                                tokio::try_join!(
                                    async {
                                        Ok::<_, diesel_outbox::Error>(
                                            insert().execute(&mut &*c).await?,
                                        )
                                    },
                                    outbox.enqueue_pipelined(c, message()),
                                )?;
                            }
                            Extra::Insert => {
                                insert().execute(c).await?;
                                insert().execute(c).await?;
                            }
                            Extra::Select => {
                                insert().execute(c).await?;
                                diesel::select(1.into_sql::<diesel::sql_types::Integer>())
                                    .get_result::<i32>(c)
                                    .await?;
                            }
                        }
                        Ok::<_, diesel_outbox::Error>(())
                    })
                    .await?;
                took[arm].push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    env.conn.batch_execute("RESET search_path").await?;
    let [without, with, pipelined, select, second_insert] = &mut took[..] else {
        unreachable!("five arms")
    };
    let without_p50 = percentile(without, 50.0);
    let (with_p50, pipelined_p50, select_p50, second_insert_p50) = (
        percentile(with, 50.0),
        percentile(pipelined, 50.0),
        percentile(select, 50.0),
        percentile(second_insert, 50.0),
    );
    // The floor of any extra statement.
    let select_extra = Some((
        "extra latency of SELECT 1 in the same transaction",
        select_p50 - without_p50,
    ));
    let params = json!({
        "transactions_each": rounds * per_round,
        "p50_without_us": round(without_p50),
        "p50_with_us": round(with_p50),
        "p50_pipelined_us": round(pipelined_p50),
        "p50_with_select_1_us": round(select_p50),
        "p50_with_second_insert_us": round(second_insert_p50),
        "mean_without_us": round(mean(without)),
        "mean_with_us": round(mean(with)),
        "mean_pipelined_us": round(mean(pipelined)),
        "mean_with_select_1_us": round(mean(select)),
        "mean_with_second_insert_us": round(mean(second_insert)),
        "payload_bytes": KIB,
    });
    let figures = vec![
        Figure {
            name: "b. enqueue's extra latency (p50)",
            value: with_p50 - without_p50,
            unit: "µs",
            baseline: select_extra,
            target: "<= 1.20 x",
            params: params.clone(),
        },
        Figure {
            name: "b′. enqueue pipelined with the insert (p50)",
            value: pipelined_p50,
            unit: "µs",
            baseline: Some(("same transaction without enqueue", without_p50)),
            target: "<= 1.10 x",
            params: params.clone(),
        },
        Figure {
            name: "b. extra latency of a second business insert (p50)",
            value: second_insert_p50 - without_p50,
            unit: "µs",
            baseline: select_extra,
            target: "(floor of an insert)",
            params: params.clone(),
        },
        Figure {
            name: "b. transaction with the enqueue (p50)",
            value: with_p50,
            unit: "µs",
            baseline: Some(("same transaction without enqueue", without_p50)),
            target: "-",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}
