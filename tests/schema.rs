//! Table names, migrations and the diesel CLI files against the real PostgreSQL.

mod common;

use common::TestSchema;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use diesel_outbox::{EnqueueExt, Error, Message, Outbox};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn table_exists(conn: &mut AsyncPgConnection, qualified: &str) -> bool {
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    diesel::sql_query("SELECT to_regclass($1) IS NOT NULL AS exists")
        .bind::<diesel::sql_types::Text, _>(qualified)
        .get_result::<Exists>(conn)
        .await
        .unwrap()
        .exists
}

async fn versions(conn: &mut AsyncPgConnection, migrations_table: &str) -> Vec<i32> {
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = Integer)]
        version: i32,
    }
    diesel::sql_query(format!(
        "SELECT version FROM {migrations_table} ORDER BY version"
    ))
    .load::<V>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|v| v.version)
    .collect()
}

async fn migrate_repeatedly_and_concurrently(outbox: Outbox, schema: &TestSchema) {
    let mut conn = schema.connect().await;
    outbox.migrate(&mut conn).await.unwrap();
    outbox.migrate(&mut conn).await.unwrap();

    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let outbox = outbox.clone();
            tokio::spawn(async move {
                let mut conn = common::connect().await;
                outbox.migrate(&mut conn).await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }

    let t = outbox.table();
    assert!(table_exists(&mut conn, t).await, "{t}");
    assert!(table_exists(&mut conn, &format!("{t}_inbox")).await);
    assert_eq!(
        versions(&mut conn, &format!("{t}_migrations")).await,
        vec![1, 2]
    );
    outbox
        .enqueue(&mut conn, Message::new("t", "works"))
        .await
        .unwrap();
    assert!(outbox.dedupe(&mut conn, "c", "k").await.unwrap());
}

#[tokio::test]
async fn migrate_twice_and_concurrently_plain_table() {
    let schema = TestSchema::new().await;
    // Qualified with the test schema so the 4 fresh connections find it; the name itself
    // is a plain custom one.
    let outbox = Outbox::builder()
        .table(schema.table("orders_outbox"))
        .build()
        .unwrap();
    migrate_repeatedly_and_concurrently(outbox, &schema).await;
}

#[tokio::test]
async fn migrate_twice_and_concurrently_schema_qualified_table_creates_the_schema() {
    let mut schema = TestSchema::new().await;
    let fresh = schema.other_schema();
    let outbox = Outbox::builder()
        .table(format!("{fresh}.events"))
        .build()
        .unwrap();
    migrate_repeatedly_and_concurrently(outbox, &schema).await;
}

#[tokio::test]
async fn unqualified_custom_table_migrates_into_the_search_path() {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder().table("orders_outbox").build().unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    assert!(table_exists(&mut conn, &schema.table("orders_outbox")).await);
    outbox
        .enqueue(&mut conn, Message::new("t", "x"))
        .await
        .unwrap();
}

#[test]
fn invalid_table_names_are_rejected() {
    let too_long = "a".repeat(60);
    for bad in [
        "",
        "Outbox",
        "1outbox",
        "out;box",
        "out\"box",
        "a.b.c",
        "app..outbox",
        ".outbox",
        "app.",
        too_long.as_str(),
    ] {
        match Outbox::builder().table(bad).build() {
            Err(Error::InvalidTable(msg)) => assert!(!msg.is_empty()),
            other => panic!("{bad:?} was not rejected: {other:?}"),
        }
    }
    let err = Outbox::builder().table(too_long).build().unwrap_err();
    assert!(err.to_string().contains("63-byte"), "{err}");
}

#[test]
fn migrations_folder_equals_the_rendered_default() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
    let mut folders: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    folders.sort();
    let rendered = Outbox::new().diesel_migrations();
    assert_eq!(
        folders.len(),
        rendered.len(),
        "one migration per schema version: {folders:?}"
    );
    for (folder, (up, down)) in folders.iter().zip(&rendered) {
        let read = |name: &str| std::fs::read_to_string(folder.join(name)).unwrap();
        if std::env::var_os("OUTBOX_WRITE_MIGRATIONS").is_some() {
            std::fs::write(folder.join("up.sql"), up).unwrap();
            std::fs::write(folder.join("down.sql"), down).unwrap();
        }
        assert_eq!(
            read("up.sql"),
            *up,
            "{folder:?} differs from Outbox::new().diesel_migrations(): rerun this test with \
             OUTBOX_WRITE_MIGRATIONS=1"
        );
        assert_eq!(read("down.sql"), *down, "{folder:?}");
    }
}

/// A table at schema version 1 (as an earlier release left it) is upgraded by `migrate`.
#[tokio::test]
async fn migrate_upgrades_a_table_left_at_version_one() {
    use diesel_async::SimpleAsyncConnection;
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("old"))
        .build()
        .unwrap();
    let (v1, _) = outbox.diesel_migrations().remove(0);
    conn.batch_execute(&v1).await.unwrap();
    let migrations_table = format!("{}_migrations", outbox.table());
    assert_eq!(versions(&mut conn, &migrations_table).await, vec![1]);
    outbox.migrate(&mut conn).await.unwrap();
    assert_eq!(versions(&mut conn, &migrations_table).await, vec![1, 2]);
    let stats = outbox.stats(&mut conn).await.unwrap();
    assert_eq!(stats.blocked_for, None);
    // And every version's down.sql takes it back, newest first.
    for (_, down) in outbox.diesel_migrations().iter().rev() {
        conn.batch_execute(down).await.unwrap();
    }
    assert!(!table_exists(&mut conn, outbox.table()).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn embedded_migrations_run_through_diesels_harness() {
    use diesel_async::AsyncMigrationHarness;
    use diesel_migrations::MigrationHarness;

    let schema = TestSchema::new().await;
    let conn = schema.connect().await;
    let mut harness = AsyncMigrationHarness::new(conn);
    let applied = harness
        .run_pending_migrations(diesel_outbox::MIGRATIONS)
        .unwrap();
    assert_eq!(applied.len(), 2);
    let mut conn = harness.into_inner();

    // The same schema as `migrate`, which therefore finds nothing to do.
    assert_eq!(versions(&mut conn, "outbox_migrations").await, vec![1, 2]);
    Outbox::new().migrate(&mut conn).await.unwrap();
    conn.enqueue(Message::new("t", "x")).await.unwrap();
    let n: Count = diesel::sql_query("SELECT count(*) AS n FROM outbox")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(n.n, 1);
}

#[tokio::test]
async fn sql_statements_build_the_same_schema() {
    use diesel_async::SimpleAsyncConnection;
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("by_hand"))
        .build()
        .unwrap();
    for statement in outbox.sql() {
        conn.batch_execute(&statement).await.unwrap();
    }
    assert_eq!(
        versions(&mut conn, &format!("{}_migrations", outbox.table())).await,
        vec![1, 2]
    );
    outbox.migrate(&mut conn).await.unwrap();
    outbox
        .enqueue(&mut conn, Message::new("t", "x"))
        .await
        .unwrap();
}
