//! The log engine against a log in memory, in paused time: its pages and their finishes as
//! the cursor moves, takeovers, attempts, and what it does when the database's cursor is
//! not where it left it (a write the database lost). No database, no broker.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

use super::page::PageRead;
use super::statements::{Advanced, CursorRow, Guard, HolderRow, Opened, PageRow};
use super::{Log, LogTable};
use crate::error::Result;
use crate::relay::options::Options;
use crate::relay::outcome::{MessageColumns, OUTCOME_DEAD, Outcome};
use crate::relay::store::{Beat, End, Finish, Holder};

#[derive(Debug, Clone)]
struct Row {
    id: i64,
    key: String,
    aggregate: Option<String>,
    /// When it committed: it is visible in the snapshots `s{n}` with `n >= commit`.
    commit: u64,
    status: &'static str,
    attempts: u32,
}

#[derive(Debug, Default)]
struct Db {
    rows: Vec<Row>,
    /// The last commit.
    commits: u64,
    cursor: Option<CursorRow>,
    owner: Option<String>,
    lease_until: Option<Instant>,
}

/// The log in memory. Snapshots are `s{n}`: every row committed at or before `n`.
struct Script {
    db: Mutex<Db>,
    /// While true, a take reads the cursor at once but answers only once it turns false.
    slow_takes: watch::Sender<bool>,
}

fn snapshot(n: u64) -> String {
    format!("s{n}")
}

fn commit_of(snapshot: &str) -> u64 {
    snapshot[1..].parse().expect("a snapshot of the script")
}

impl Script {
    /// A table on the log engine, its cursor before any row.
    fn new() -> Arc<Self> {
        let db = Db {
            cursor: Some(CursorRow {
                lo: snapshot(0),
                hi: snapshot(0),
                ceiling: 0,
                after: 0,
                walk_from: 0,
                tick: 0,
                page_attempts: 0,
                token: 0,
            }),
            ..Db::default()
        };
        Arc::new(Script {
            db: Mutex::new(db),
            slow_takes: watch::Sender::new(false),
        })
    }

    fn db(&self) -> std::sync::MutexGuard<'_, Db> {
        self.db.lock().unwrap()
    }

    /// Commits one row of the log per key, each in a transaction of its own.
    fn commit(&self, keys: &[(&str, Option<&str>)]) {
        let mut db = self.db();
        for (key, aggregate) in keys {
            db.commits += 1;
            let row = Row {
                id: i64::try_from(db.rows.len()).unwrap() + 1,
                key: (*key).to_owned(),
                aggregate: aggregate.map(str::to_owned),
                commit: db.commits,
                status: "logged",
                attempts: 0,
            };
            db.rows.push(row);
        }
    }

    fn cursor(&self) -> CursorRow {
        self.db().cursor.clone().unwrap()
    }

    fn status(&self, key: &str) -> (&'static str, u32) {
        let db = self.db();
        let row = db.rows.iter().find(|r| r.key == key).unwrap();
        (row.status, row.attempts)
    }
}

impl LogTable for Script {
    fn take<'a>(
        &'a self,
        owner: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<CursorRow>>> {
        let taken = {
            let mut db = self.db();
            let expired = db.lease_until.is_none_or(|at| at <= Instant::now());
            let mine = db.owner.as_deref() == Some(owner);
            if db.cursor.is_some() && (mine || db.owner.is_none() || expired) {
                let previous = db.owner.clone();
                let cursor = db.cursor.as_mut().unwrap();
                if !mine {
                    cursor.token += 1;
                    if previous.is_some() && cursor.after < cursor.ceiling {
                        cursor.page_attempts += 1;
                    }
                }
                let cursor = cursor.clone();
                db.owner = Some(owner.to_owned());
                db.lease_until = Some(Instant::now() + lease);
                Some(cursor)
            } else {
                None
            }
        };
        let mut answers = self.slow_takes.subscribe();
        Box::pin(async move {
            let _ = answers.wait_for(|slow| !*slow).await;
            Ok(taken)
        })
    }

    fn open_tick<'a>(
        &'a self,
        at: &'a CursorRow,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Opened>> {
        let mut db = self.db();
        let now = db.commits;
        let current = db.cursor.clone();
        let opened = current.as_ref().and_then(|c| {
            let done_as_known = c.token == at.token
                && c.tick == at.tick
                && c.after == at.ceiling
                && c.ceiling == at.ceiling
                && c.hi == at.hi;
            let old = commit_of(&c.hi);
            let fresh: Vec<i64> = db
                .rows
                .iter()
                .filter(|r| r.status == "logged" && r.commit > old && r.commit <= now)
                .map(|r| r.id)
                .collect();
            (done_as_known && !fresh.is_empty()).then(|| CursorRow {
                lo: c.hi.clone(),
                hi: snapshot(now),
                ceiling: *fresh.iter().max().unwrap(),
                after: fresh.iter().min().unwrap() - 1,
                walk_from: 0,
                tick: c.tick + 1,
                page_attempts: 0,
                token: c.token,
            })
        });
        let answer = match opened {
            Some(row) => {
                db.cursor = Some(row.clone());
                db.lease_until = Some(Instant::now() + lease);
                Opened::Tick(row)
            }
            None => Opened::Not(current),
        };
        Box::pin(async move { Ok(answer) })
    }

    fn read_page<'a>(
        &'a self,
        at: &'a CursorRow,
        from: i64,
        limit: usize,
        _max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<PageRow>>> {
        let db = self.db();
        let (lo, hi) = (commit_of(&at.lo), commit_of(&at.hi));
        let mut rows: Vec<&Row> = db
            .rows
            .iter()
            .filter(|r| r.status == "logged" && r.commit > lo && r.commit <= hi)
            .filter(|r| r.id > from && r.id <= at.ceiling)
            .collect();
        rows.sort_by_key(|r| r.id);
        rows.truncate(limit);
        // As the statement: the rows found (up to `limit`), less the last of `limit`.
        let read = i64::try_from(rows.len()).unwrap();
        let page = rows
            .into_iter()
            .take(limit - 1)
            .map(|r| PageRow {
                message: MessageColumns::for_test(r.id, &r.key, r.aggregate.as_deref()),
                delayed: false,
                read,
            })
            .collect();
        Box::pin(async move { Ok(page) })
    }

    fn pending_aggregates<'a>(
        &'a self,
        keys: Vec<String>,
        besides: Vec<i64>,
    ) -> BoxFuture<'a, Result<HashSet<String>>> {
        let db = self.db();
        let found = db
            .rows
            .iter()
            .filter(|r| r.status == "pending" && !besides.contains(&r.id))
            .filter_map(|r| r.aggregate.clone())
            .filter(|a| keys.contains(a))
            .collect();
        Box::pin(async move { Ok(found) })
    }

    fn advance<'a>(
        &'a self,
        guard: Guard,
        to: i64,
        page_attempts: i32,
        hand_over: &'a [Outcome],
        _lease: Duration,
    ) -> BoxFuture<'a, Result<Advanced>> {
        let mut db = self.db();
        let answer = match db.cursor.as_mut() {
            Some(c) if c.token == guard.token && c.tick == guard.tick && c.after == guard.from => {
                c.after = to;
                c.page_attempts = page_attempts;
                for outcome in hand_over {
                    let row = db.rows.iter_mut().find(|r| r.id == outcome.id).unwrap();
                    row.status = if outcome.kind == OUTCOME_DEAD {
                        "dead"
                    } else {
                        "pending"
                    };
                    row.attempts = outcome.attempt;
                }
                Advanced::Moved
            }
            c => Advanced::Guarded {
                token: c.map(|c| c.token),
            },
        };
        Box::pin(async move { Ok(answer) })
    }

    fn committed<'a>(&'a self, hi: &'a str) -> BoxFuture<'a, Result<bool>> {
        let db = self.db();
        let since = commit_of(hi);
        let found = db
            .rows
            .iter()
            .any(|r| r.status == "logged" && r.commit > since);
        Box::pin(async move { Ok(found) })
    }

    fn give_back<'a>(&'a self, owner: &'a str, token: i64) -> BoxFuture<'a, Result<()>> {
        let mut db = self.db();
        if db.owner.as_deref() == Some(owner) && db.cursor.as_ref().map(|c| c.token) == Some(token)
        {
            db.owner = None;
            db.lease_until = Some(Instant::now());
        }
        Box::pin(async { Ok(()) })
    }

    fn holder(&self) -> BoxFuture<'_, Result<Option<HolderRow>>> {
        let db = self.db();
        let holder = db.cursor.as_ref().map(|_| HolderRow {
            owner: db.owner.clone(),
            lease_left_us: db.lease_until.map_or(0, |at| {
                i64::try_from(at.saturating_duration_since(Instant::now()).as_micros()).unwrap()
            }),
        });
        Box::pin(async move { Ok(holder) })
    }
}

fn log_on(script: &Arc<Script>, owner: &str) -> Arc<Log> {
    Log::new(script.clone(), "t".to_owned(), owner.to_owned())
}

fn options(batch_size: usize) -> Options {
    Options {
        batch_size,
        ..Options::default()
    }
}

/// The next page of at most `room` rows, which must come.
async fn page(log: &Arc<Log>, room: usize) -> PageRead {
    log.next_page(&options(room), room, Vec::new())
        .await
        .unwrap()
        .expect("a page")
}

fn keys(read: &PageRead) -> Vec<String> {
    read.ready.iter().map(|c| c.record.key.clone()).collect()
}

fn end() -> End {
    End {
        outage: false,
        by: Instant::now() + Duration::from_secs(60),
        stop: watch::channel(false).1,
    }
}

/// Finishes `read` with every record confirmed; returns how many outcomes were fenced off.
async fn confirm(read: PageRead) -> usize {
    let outcomes = read
        .ready
        .iter()
        .map(|c| Outcome::sent(&c.record, c.token))
        .collect();
    Box::new(read.page).finish(outcomes, end()).await
}

#[tokio::test(start_paused = true)]
async fn pages_follow_one_another_and_the_next_tick_opens_after_the_last() {
    let script = Script::new();
    script.commit(&[
        ("a", None),
        ("b", None),
        ("c", None),
        ("d", None),
        ("e", None),
    ]);
    let log = log_on(&script, "relay-1");
    let first = page(&log, 2).await;
    let second = page(&log, 2).await;
    let third = page(&log, 2).await;
    assert_eq!(
        [keys(&first), keys(&second), keys(&third)],
        [vec!["a", "b"], vec!["c", "d"], vec!["e"]]
    );
    assert!(
        log.next_page(&options(2), 2, Vec::new())
            .await
            .unwrap()
            .is_none(),
        "no tick opens while pages of the last are out"
    );
    // Finished out of order, they still move the cursor in page order.
    let f3 = tokio::spawn(confirm(third));
    let f2 = tokio::spawn(confirm(second));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        script.cursor().after,
        0,
        "the later pages wait for the first"
    );
    assert_eq!(confirm(first).await, 0);
    assert_eq!((f2.await.unwrap(), f3.await.unwrap()), (0, 0));
    assert_eq!(script.cursor().after, 5);
    script.commit(&[("f", None)]);
    let next = page(&log, 2).await;
    assert_eq!(keys(&next), ["f"]);
    assert_eq!(script.cursor().tick, 2);
}

/// The database lost the cursor's last writes (the relay left it at 5, it holds 3): the
/// tick open tells that apart from "nothing new", and the relay reads on from 3, so the
/// message committed since is published too.
#[tokio::test(start_paused = true)]
async fn a_cursor_the_database_moved_back_is_read_from_where_it_is() {
    let script = Script::new();
    script.commit(&[
        ("a", None),
        ("b", None),
        ("c", None),
        ("d", None),
        ("e", None),
    ]);
    let log = log_on(&script, "relay-1");
    assert_eq!(confirm(page(&log, 10).await).await, 0);
    assert_eq!(script.cursor().after, 5);
    script.db().cursor.as_mut().unwrap().after = 3;
    script.commit(&[("f", None)]);
    let again = page(&log, 10).await;
    assert_eq!(keys(&again), ["d", "e"], "published again");
    assert_eq!(confirm(again).await, 0);
    let next = page(&log, 10).await;
    assert_eq!(keys(&next), ["f"]);
}

/// The same loss found by the renewal of the lease, mid-tick, with no page out.
#[tokio::test(start_paused = true)]
async fn a_renewal_that_finds_the_cursor_moved_back_reads_from_there() {
    let script = Script::new();
    script.commit(&[("a", None), ("b", None), ("c", None), ("d", None)]);
    let log = log_on(&script, "relay-1");
    assert_eq!(confirm(page(&log, 2).await).await, 0);
    assert_eq!(script.cursor().after, 2);
    script.db().cursor.as_mut().unwrap().after = 1;
    // Half the lease later the relay renews it, and finds the cursor at 1.
    tokio::time::advance(options(2).cursor_lease / 2).await;
    let next = page(&log, 2).await;
    assert_eq!(keys(&next), ["b", "c"]);
}

/// A take answered with the cursor as it was before this relay's own finish, which
/// committed meanwhile: the relay keeps what it wrote, and does not go back over the page.
#[tokio::test(start_paused = true)]
async fn a_renewal_older_than_the_relays_own_finish_is_not_believed() {
    let script = Script::new();
    script.commit(&[("a", None), ("b", None), ("c", None), ("d", None)]);
    let log = log_on(&script, "relay-1");
    let first = page(&log, 2).await;
    tokio::time::advance(options(2).cursor_lease / 2).await;
    // The renewal reads the cursor at 0 and answers late; the page's finish (to 2) comes
    // in between.
    script.slow_takes.send_replace(true);
    let reading = tokio::spawn({
        let log = log.clone();
        async move { log.next_page(&options(2), 2, Vec::new()).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(confirm(first).await, 0);
    script.slow_takes.send_replace(false);
    let next = reading.await.unwrap().unwrap().expect("a page");
    assert_eq!(keys(&next), ["c", "d"], "nothing read twice");
    assert_eq!(confirm(next).await, 0);
    assert_eq!(script.cursor().after, 4);
}

/// Another relay took the cursor over while a page was out: its finish moves nothing, its
/// outcomes are fenced off, and this relay no longer holds the cursor.
#[tokio::test(start_paused = true)]
async fn a_page_out_when_another_relay_takes_over_is_fenced() {
    let script = Script::new();
    script.commit(&[("a", None), ("b", None)]);
    let log = log_on(&script, "relay-1");
    let read = page(&log, 10).await;
    tokio::time::advance(options(10).cursor_lease).await;
    let other = log_on(&script, "relay-2");
    let again = page(&other, 10).await;
    assert_eq!(keys(&again), ["a", "b"]);
    assert_eq!(script.cursor().page_attempts, 1, "the takeover counted");
    assert_eq!(confirm(read).await, 2, "fenced");
    assert_eq!(script.cursor().after, 0);
    assert_eq!(confirm(again).await, 0);
    assert_eq!(
        (script.cursor().after, script.cursor().page_attempts),
        (2, 0)
    );
}

/// Attempts count against the page that did not finish: its first finish forgets them,
/// and the pages after it are full again, their records on their first attempt.
#[tokio::test(start_paused = true)]
async fn only_the_page_that_did_not_finish_counts_an_attempt() {
    let script = Script::new();
    let keys_: Vec<String> = (0..12).map(|i| format!("k{i:02}")).collect();
    let rows: Vec<(&str, Option<&str>)> = keys_.iter().map(|k| (k.as_str(), None)).collect();
    script.commit(&rows);
    let log = log_on(&script, "relay-1");
    // The tick opens; then two relays die on its first page.
    drop(page(&log, 4).await);
    script.db().cursor.as_mut().unwrap().page_attempts = 2;
    tokio::time::advance(options(4).cursor_lease).await;
    let log = log_on(&script, "relay-2");
    let first = page(&log, 4).await;
    assert_eq!(keys(&first), ["k00"], "four rows, halved three times");
    assert_eq!(first.ready[0].record.attempt, 4, "on its fourth attempt");
    assert_eq!(confirm(first).await, 0);
    assert_eq!(script.cursor().page_attempts, 0);
    let next = page(&log, 4).await;
    assert_eq!(keys(&next), ["k01", "k02", "k03", "k04"]);
    assert!(next.ready.iter().all(|c| c.record.attempt == 1));
}

/// A row that every relay dies on ends alone in its page, and once pages have failed
/// max_attempts times at its place it goes to the per-row side with those attempts spent
/// (its next claim there ends it dead); the rows after it go on as before, on their first
/// attempt.
#[tokio::test(start_paused = true)]
async fn a_row_read_alone_too_often_goes_to_the_per_row_side_spent() {
    let script = Script::new();
    script.commit(&[("poison", None), ("next", None)]);
    let max = options(4).max_attempts;
    let log = log_on(&script, "relay-1");
    drop(page(&log, 4).await);
    // Pages failed there `max` times, the last of them counted by the takeover below.
    script.db().cursor.as_mut().unwrap().page_attempts = i32::try_from(max).unwrap() - 1;
    tokio::time::advance(options(4).cursor_lease).await;
    let log = log_on(&script, "relay-2");
    let read = log
        .next_page(&options(4), 4, Vec::new())
        .await
        .unwrap()
        .expect("a page");
    assert!(read.ready.is_empty(), "the poison row is not published");
    assert_eq!(confirm(read).await, 0);
    assert_eq!(script.status("poison"), ("pending", max));
    assert_eq!(script.status("next"), ("logged", 0));
    let next = page(&log, 4).await;
    assert_eq!(keys(&next), ["next"]);
    assert_eq!(next.ready[0].record.attempt, 1);
}

/// A page's message whose aggregate has rows on the per-row side goes there too, after
/// them, unless those rows are the batch's own (which go out first, in the same batch).
#[tokio::test(start_paused = true)]
async fn a_message_behind_its_aggregate_on_the_per_row_side_follows_it() {
    let script = Script::new();
    script.commit(&[("a1", Some("a")), ("b1", Some("b"))]);
    {
        let mut db = script.db();
        db.commits += 1;
        let commit = db.commits;
        for (id, key, aggregate) in [(100, "a0", "a"), (101, "b0", "b")] {
            db.rows.push(Row {
                id,
                key: key.to_owned(),
                aggregate: Some(aggregate.to_owned()),
                commit,
                status: "pending",
                attempts: 1,
            });
        }
    }
    let log = log_on(&script, "relay-1");
    // The batch's per-row claim took b0 (id 101), not a0.
    let read = log
        .next_page(&options(10), 10, vec![101])
        .await
        .unwrap()
        .expect("a page");
    assert_eq!(keys(&read), ["b1"], "b1 goes out after b0, in its batch");
    let outcomes: Vec<Outcome> = read
        .ready
        .iter()
        .map(|c| Outcome::sent(&c.record, c.token))
        .collect();
    assert_eq!(Box::new(read.page).finish(outcomes, end()).await, 0);
    assert_eq!(script.status("a1"), ("pending", 0), "handed over behind a0");
    assert_eq!(script.status("b1"), ("logged", 0));
}

/// A page whose messages failed hands them over with their attempt spent, and the
/// cursor moves past the page; one cut short by an outage moves only past its confirmed
/// prefix and costs nothing.
#[tokio::test(start_paused = true)]
async fn failures_are_handed_over_and_an_outage_leaves_the_rest_for_later() {
    let script = Script::new();
    script.commit(&[("a", None), ("b", None), ("c", None)]);
    let log = log_on(&script, "relay-1");
    let read = page(&log, 10).await;
    let outcomes = vec![
        Outcome::sent(&read.ready[0].record, read.ready[0].token),
        Outcome::retry(
            &read.ready[1].record,
            read.ready[1].token,
            Duration::from_secs(1),
            &"no",
        ),
    ];
    let cut = End {
        outage: true,
        ..end()
    };
    assert_eq!(Box::new(read.page).finish(outcomes, cut).await, 0);
    assert_eq!(script.status("b"), ("pending", 1));
    assert_eq!(script.cursor().after, 2, "c was not published: read again");
    let again = page(&log, 10).await;
    assert_eq!(keys(&again), ["c"]);
}

/// The heartbeat keeps a live relay's cursor however long it idles, a standby names the
/// holder and its lease, and the standby takes over one lease after the heartbeats stop.
#[tokio::test(start_paused = true)]
async fn a_heartbeat_keeps_the_cursor_and_a_standby_takes_it_once_the_beats_stop() {
    let script = Script::new();
    script.commit(&[("a", None)]);
    let lease = options(10).cursor_lease;
    let (holder, standby) = (log_on(&script, "relay-1"), log_on(&script, "relay-2"));
    holder.join();
    standby.join();
    assert_eq!(confirm(page(&holder, 10).await).await, 0);
    // Four leases of beats: the holder keeps it, the standby waits and says for whom.
    for _ in 0..20 {
        tokio::time::advance(options(10).heartbeat()).await;
        assert_eq!(holder.keep(&options(10)).await.unwrap(), Beat::Held);
        assert_eq!(
            standby.keep(&options(10)).await.unwrap(),
            Beat::Waiting(Holder {
                name: "relay-1".to_owned(),
                lease_left: lease,
            })
        );
    }
    // The holder dies: its beats stop. Within a lease the standby takes over.
    tokio::time::advance(lease - Duration::from_millis(1)).await;
    assert!(matches!(
        standby.keep(&options(10)).await.unwrap(),
        Beat::Waiting(Holder { lease_left, .. }) if lease_left == Duration::from_millis(1)
    ));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(standby.keep(&options(10)).await.unwrap(), Beat::Took);
    script.commit(&[("b", None)]);
    assert_eq!(keys(&page(&standby, 10).await), ["b"]);
}

/// A relay whose last run left gave the cursor back; a heartbeat still under way then takes
/// nothing, so another relay takes over at once.
#[tokio::test(start_paused = true)]
async fn no_heartbeat_takes_the_cursor_back_after_the_last_run_gave_it_back() {
    let script = Script::new();
    script.commit(&[("a", None)]);
    let log = log_on(&script, "relay-1");
    log.join();
    assert_eq!(log.keep(&options(10)).await.unwrap(), Beat::Took);
    log.leave().await;
    assert_eq!(log.keep(&options(10)).await.unwrap(), Beat::Off);
    assert_eq!(script.db().owner, None);
    let other = log_on(&script, "relay-2");
    other.join();
    assert_eq!(other.keep(&options(10)).await.unwrap(), Beat::Took);
}
