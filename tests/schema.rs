//! Table names, migrations and the diesel CLI files against the real PostgreSQL.

mod common;

use common::Alone;

use common::TestSchema;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use diesel_outbox::{Error, Message, Outbox};

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
        vec![1, 2, 3, 4, 5]
    );
    outbox
        .enqueue_alone(&mut conn, Message::new("t", "works"))
        .await
        .unwrap();
    assert!(outbox.dedupe_alone(&mut conn, "c", "k").await.unwrap());
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
        .enqueue_alone(&mut conn, Message::new("t", "x"))
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
    for (folder, m) in folders.iter().zip(&rendered) {
        let read = |name: &str| std::fs::read_to_string(folder.join(name)).unwrap();
        if std::env::var_os("OUTBOX_WRITE_MIGRATIONS").is_some() {
            std::fs::write(folder.join("up.sql"), &m.up).unwrap();
            std::fs::write(folder.join("down.sql"), &m.down).unwrap();
        }
        assert_eq!(
            folder.file_name().unwrap().to_string_lossy(),
            m.folder,
            "the folder's name"
        );
        assert_eq!(
            read("up.sql"),
            m.up,
            "{folder:?} differs from Outbox::new().diesel_migrations(): rerun this test with \
             OUTBOX_WRITE_MIGRATIONS=1"
        );
        assert_eq!(read("down.sql"), m.down, "{folder:?}");
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
    let v1 = outbox.diesel_migrations().remove(0);
    conn.batch_execute(&v1.up).await.unwrap();
    let migrations_table = format!("{}_migrations", outbox.table());
    assert_eq!(versions(&mut conn, &migrations_table).await, vec![1]);
    outbox.migrate(&mut conn).await.unwrap();
    assert_eq!(
        versions(&mut conn, &migrations_table).await,
        vec![1, 2, 3, 4, 5]
    );
    let stats = outbox.stats(&mut conn).await.unwrap();
    assert_eq!(stats.blocked_for, None);
    assert_eq!(fillfactor(&mut conn, outbox.table()).await, "fillfactor=50");
    // And every version's down.sql takes it back, newest first.
    for m in outbox.diesel_migrations().iter().rev() {
        conn.batch_execute(&m.down).await.unwrap();
    }
    assert!(!table_exists(&mut conn, outbox.table()).await);
}

#[tokio::test]
async fn a_ledger_without_its_table_is_named_and_nothing_changes() {
    use diesel_async::SimpleAsyncConnection;
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("orphaned"))
        .build()
        .unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    let migrations_table = format!("{}_migrations", outbox.table());
    conn.batch_execute(&format!(
        "DROP TABLE {t}; DROP TABLE {t}_inbox",
        t = outbox.table()
    ))
    .await
    .unwrap();
    let err = outbox.migrate(&mut conn).await.unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::Migration(_)), "{err:?}");
    assert!(
        message.contains(&format!(
            "the migration ledger {migrations_table} records schema version 5, but {t}, {t}_inbox do not exist",
            t = outbox.table()
        )),
        "{message}"
    );
    assert!(
        message.contains(&format!("drop {migrations_table}")),
        "{message}"
    );
    assert!(!message.contains("run `migrate`"), "{message}");
    // Nothing was created or recorded.
    assert!(!table_exists(&mut conn, outbox.table()).await);
    assert!(!table_exists(&mut conn, &format!("{}_inbox", outbox.table())).await);
    assert_eq!(
        versions(&mut conn, &migrations_table).await,
        vec![1, 2, 3, 4, 5]
    );
    // As the message says: dropping the ledger starts over.
    conn.batch_execute(&format!("DROP TABLE {migrations_table}"))
        .await
        .unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    assert!(table_exists(&mut conn, outbox.table()).await);
}

/// The table's `fillfactor` storage parameter, as `pg_class.reloptions` holds it.
async fn fillfactor(conn: &mut AsyncPgConnection, table: &str) -> String {
    #[derive(diesel::QueryableByName)]
    struct Opt {
        #[diesel(sql_type = diesel::sql_types::Text)]
        opt: String,
    }
    diesel::sql_query(
        "SELECT o AS opt FROM pg_class, unnest(reloptions) AS o \
         WHERE oid = $1::regclass AND o LIKE 'fillfactor=%'",
    )
    .bind::<diesel::sql_types::Text, _>(table)
    .get_result::<Opt>(conn)
    .await
    .unwrap()
    .opt
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
    assert_eq!(applied.len(), 5);
    let mut conn = harness.into_inner();

    // The same schema as `migrate`, which therefore finds nothing to do.
    assert_eq!(
        versions(&mut conn, "outbox_migrations").await,
        vec![1, 2, 3, 4, 5]
    );
    Outbox::new().migrate(&mut conn).await.unwrap();
    Outbox::new()
        .enqueue_alone(&mut conn, Message::new("t", "x"))
        .await
        .unwrap();
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
        vec![1, 2, 3, 4, 5]
    );
    outbox.migrate(&mut conn).await.unwrap();
    outbox
        .enqueue_alone(&mut conn, Message::new("t", "x"))
        .await
        .unwrap();
}

/// `outbox.migrations()` runs any table's schema through diesel's own harness: two tables
/// side by side do not collide in `__diesel_schema_migrations`, `migrate` afterwards finds
/// nothing to do, and reverting takes the table away.
#[tokio::test(flavor = "multi_thread")]
async fn a_custom_table_runs_through_diesels_harness_and_reverts() {
    use diesel_async::AsyncMigrationHarness;
    use diesel_migrations::MigrationHarness;

    let schema = TestSchema::new().await;
    let first = Outbox::builder()
        .table(schema.table("first_outbox"))
        .build()
        .unwrap();
    let second = Outbox::builder()
        .table(schema.table("second_outbox"))
        .build()
        .unwrap();
    let mut harness = AsyncMigrationHarness::new(schema.connect().await);
    for outbox in [&first, &second] {
        let applied = harness.run_pending_migrations(outbox.migrations()).unwrap();
        assert_eq!(applied.len(), 5, "{}", outbox.table());
    }
    assert!(
        harness
            .run_pending_migrations(first.migrations())
            .unwrap()
            .is_empty()
    );
    let mut conn = harness.into_inner();
    for outbox in [&first, &second] {
        assert_eq!(
            versions(&mut conn, &format!("{}_migrations", outbox.table())).await,
            vec![1, 2, 3, 4, 5]
        );
        outbox.migrate(&mut conn).await.unwrap();
        outbox
            .enqueue_alone(&mut conn, Message::new("t", "x"))
            .await
            .unwrap();
    }
    // A harness reverts only versions its source knows: an app with two outbox tables (or
    // with migrations of its own) hands it all of them.
    struct Both(Vec<diesel_outbox::OutboxMigrations>);
    impl diesel::migration::MigrationSource<diesel::pg::Pg> for Both {
        fn migrations(
            &self,
        ) -> diesel::migration::Result<Vec<Box<dyn diesel::migration::Migration<diesel::pg::Pg>>>>
        {
            let mut all = Vec::new();
            for source in &self.0 {
                all.extend(source.migrations()?);
            }
            Ok(all)
        }
    }
    let mut harness = AsyncMigrationHarness::new(conn);
    let reverted = harness
        .revert_all_migrations(Both(vec![first.migrations(), second.migrations()]))
        .unwrap();
    assert_eq!(reverted.len(), 10);
    let mut conn = harness.into_inner();
    assert!(!table_exists(&mut conn, first.table()).await);
    assert!(!table_exists(&mut conn, second.table()).await);
}

/// The `table!` definitions of `diesel_outbox::schema` describe the migrated default tables:
/// the same columns in the same order, the same types and nullability, the same primary keys.
#[tokio::test]
async fn the_table_definitions_match_the_migrated_schema() {
    use diesel::sql_types::{self, SqlType};
    use diesel::{Column, Expression, Table};
    use diesel_outbox::schema::{
        outbox, outbox_cursor, outbox_inbox, outbox_migrations, outbox_relays,
    };

    /// PostgreSQL's name (`udt_name`) of a Diesel SQL type, and whether it is nullable.
    trait Described {
        const NAME: &'static str;
        const NULLABLE: bool = false;
    }
    macro_rules! described {
        ($($ty:ty => $name:literal),* $(,)?) => {
            $(impl Described for $ty { const NAME: &'static str = $name; })*
        };
    }
    described!(
        sql_types::BigInt => "int8",
        sql_types::Integer => "int4",
        sql_types::Text => "text",
        sql_types::Bytea => "bytea",
        sql_types::Jsonb => "jsonb",
        sql_types::Bool => "bool",
        sql_types::Timestamptz => "timestamptz",
        diesel_outbox::schema::sql_types::Xid8 => "xid8",
        diesel_outbox::schema::sql_types::PgSnapshot => "pg_snapshot",
    );
    impl<T: Described + SqlType> Described for sql_types::Nullable<T> {
        const NAME: &'static str = T::NAME;
        const NULLABLE: bool = true;
    }
    fn column<C>() -> (String, String, bool)
    where
        C: Column + Expression,
        C::SqlType: Described,
    {
        (
            C::NAME.to_owned(),
            <C::SqlType as Described>::NAME.to_owned(),
            <C::SqlType as Described>::NULLABLE,
        )
    }
    /// The column names `all_columns` selects, in order, as the query builder writes them.
    fn all_columns<T>(table: T) -> Vec<String>
    where
        T: Table + diesel::query_dsl::methods::SelectDsl<T::AllColumns>,
        diesel::dsl::Select<T, T::AllColumns>: diesel::query_builder::QueryFragment<diesel::pg::Pg>,
    {
        let sql =
            diesel::debug_query::<diesel::pg::Pg, _>(&table.select(T::all_columns())).to_string();
        let list = sql
            .strip_prefix("SELECT ")
            .and_then(|s| s.split(" FROM ").next())
            .expect("a select");
        list.split(", ")
            .map(|c| c.rsplit('.').next().unwrap().trim_matches('"').to_owned())
            .collect()
    }

    /// A table: its name, its declared columns (name, type, nullable), the columns its
    /// `all_columns` selects, and its declared primary key.
    type Declared = (
        &'static str,
        Vec<(String, String, bool)>,
        Vec<String>,
        Vec<&'static str>,
    );
    let declared: Vec<Declared> = vec![
        (
            "outbox",
            vec![
                column::<outbox::id>(),
                column::<outbox::idempotency_key>(),
                column::<outbox::topic>(),
                column::<outbox::aggregate_key>(),
                column::<outbox::payload>(),
                column::<outbox::content_type>(),
                column::<outbox::headers>(),
                column::<outbox::status>(),
                column::<outbox::attempts>(),
                column::<outbox::fencing_token>(),
                column::<outbox::available_at>(),
                column::<outbox::lease_until>(),
                column::<outbox::last_error>(),
                column::<outbox::created_at>(),
                column::<outbox::sent_at>(),
                column::<outbox::dead_at>(),
                column::<outbox::xid>(),
            ],
            all_columns(outbox::table),
            vec![<outbox::table as Table>::PrimaryKey::NAME],
        ),
        (
            "outbox_inbox",
            vec![
                column::<outbox_inbox::consumer>(),
                column::<outbox_inbox::idempotency_key>(),
                column::<outbox_inbox::processed_at>(),
            ],
            all_columns(outbox_inbox::table),
            vec![
                outbox_inbox::consumer::NAME,
                outbox_inbox::idempotency_key::NAME,
            ],
        ),
        (
            "outbox_migrations",
            vec![
                column::<outbox_migrations::version>(),
                column::<outbox_migrations::applied_at>(),
            ],
            all_columns(outbox_migrations::table),
            vec![<outbox_migrations::table as Table>::PrimaryKey::NAME],
        ),
        (
            "outbox_relays",
            vec![
                column::<outbox_relays::relay_id>(),
                column::<outbox_relays::idle>(),
                column::<outbox_relays::expires_at>(),
                column::<outbox_relays::blocked_since>(),
            ],
            all_columns(outbox_relays::table),
            vec![<outbox_relays::table as Table>::PrimaryKey::NAME],
        ),
        (
            "outbox_cursor",
            vec![
                column::<outbox_cursor::part>(),
                column::<outbox_cursor::lo>(),
                column::<outbox_cursor::hi>(),
                column::<outbox_cursor::ceiling>(),
                column::<outbox_cursor::after>(),
                column::<outbox_cursor::tick>(),
                column::<outbox_cursor::page_attempts>(),
                column::<outbox_cursor::owner>(),
                column::<outbox_cursor::lease_until>(),
                column::<outbox_cursor::token>(),
                column::<outbox_cursor::walk_from>(),
            ],
            all_columns(outbox_cursor::table),
            vec![<outbox_cursor::table as Table>::PrimaryKey::NAME],
        ),
    ];
    // `outbox_inbox`'s key is a pair: check the table! says so too.
    let _: (outbox_inbox::consumer, outbox_inbox::idempotency_key) =
        <outbox_inbox::table as Table>::primary_key(&outbox_inbox::table);

    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    Outbox::new().migrate(&mut conn).await.unwrap();
    #[derive(QueryableByName, Debug)]
    struct Catalog {
        #[diesel(sql_type = diesel::sql_types::Text)]
        column_name: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        udt_name: String,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        nullable: bool,
    }
    #[derive(QueryableByName)]
    struct Key {
        #[diesel(sql_type = diesel::sql_types::Text)]
        column_name: String,
    }
    let tables: Vec<String> = declared.iter().map(|(t, ..)| t.to_string()).collect();
    for (table, columns, selected, key) in declared {
        let catalog: Vec<Catalog> = diesel::sql_query(
            "SELECT column_name::text, udt_name::text, is_nullable = 'YES' AS nullable \
             FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 \
             ORDER BY ordinal_position",
        )
        .bind::<diesel::sql_types::Text, _>(&schema.name)
        .bind::<diesel::sql_types::Text, _>(table)
        .load(&mut conn)
        .await
        .unwrap();
        let in_database: Vec<(String, String, bool)> = catalog
            .into_iter()
            .map(|c| (c.column_name, c.udt_name, c.nullable))
            .collect();
        assert_eq!(columns, in_database, "{table}: columns, types, nullability");
        let names: Vec<String> = columns.iter().map(|(n, ..)| n.clone()).collect();
        assert_eq!(
            selected, names,
            "{table}: the table! lists every column, in order"
        );
        let keys: Vec<Key> = diesel::sql_query(
            "SELECT a.attname::text AS column_name FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
             WHERE i.indrelid = format('%I.%I', $1::text, $2::text)::regclass AND i.indisprimary \
             ORDER BY array_position(i.indkey::int2[], a.attnum)",
        )
        .bind::<diesel::sql_types::Text, _>(&schema.name)
        .bind::<diesel::sql_types::Text, _>(table)
        .load(&mut conn)
        .await
        .unwrap();
        let keys: Vec<String> = keys.into_iter().map(|k| k.column_name).collect();
        assert_eq!(keys, key, "{table}: primary key");
    }
    // And no table of the migration is missing from `schema`.
    #[derive(QueryableByName)]
    struct Name {
        #[diesel(sql_type = diesel::sql_types::Text)]
        table_name: String,
    }
    let mut created: Vec<String> = diesel::sql_query(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
    )
    .bind::<diesel::sql_types::Text, _>(&schema.name)
    .load::<Name>(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .map(|n| n.table_name)
    .collect();
    created.sort();
    let mut tables = tables;
    tables.sort();
    assert_eq!(created, tables);
}

/// A typed Diesel join of `outbox` with a table of the application's own crate.
#[tokio::test]
async fn the_outbox_table_joins_with_an_application_table() {
    use diesel::query_source::TableNotEqual;
    use diesel::{ExpressionMethods, JoinOnDsl, NullableExpressionMethods, QueryDsl};
    use diesel_async::SimpleAsyncConnection;
    use diesel_outbox::schema::outbox;

    diesel::table! {
        orders (id) {
            id -> BigInt,
            reference -> Text,
        }
    }
    impl TableNotEqual<outbox::table> for orders::table {}
    impl TableNotEqual<orders::table> for outbox::table {}

    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    Outbox::new().migrate(&mut conn).await.unwrap();
    conn.batch_execute(
        "CREATE TABLE orders (id bigint PRIMARY KEY, reference text NOT NULL); \
         INSERT INTO orders VALUES (1, 'order-1'), (2, 'order-2')",
    )
    .await
    .unwrap();
    Outbox::new()
        .enqueue_alone(
            &mut conn,
            Message::new("order.created", "x").aggregate_key("order-2"),
        )
        .await
        .unwrap();
    let waiting: Vec<(String, String, i32)> = orders::table
        .inner_join(outbox::table.on(outbox::aggregate_key.eq(orders::reference.nullable())))
        .filter(outbox::status.eq("pending"))
        .select((orders::reference, outbox::topic, outbox::attempts))
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        waiting,
        [("order-2".to_owned(), "order.created".to_owned(), 0)]
    );
}
