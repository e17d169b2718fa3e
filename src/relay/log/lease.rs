//! The cursor's lease between pages: a heartbeat renews it apart from the page reads and
//! finishes (which renew it too), so that a live relay keeps it however long a page takes
//! to publish or however long it idles, and a relay that died loses it one lease later,
//! not one row lease later. A relay that cannot take it stands by, and says whom for.

use std::time::Duration;

use super::Log;
use super::cursor::Taken;
use crate::error::Result;
use crate::relay::options::Options;
use crate::relay::store::{Beat, Holder};

impl Log {
    /// One heartbeat: renews the cursor's lease, takes it when it is free (expired or given
    /// back), or finds who holds it.
    pub(crate) async fn keep(&self, options: &Options) -> Result<Beat> {
        // A give-back waits for this take, and no take starts once the last run left.
        let _beat = self.beat.lock().await;
        if self.runs.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            return Ok(Beat::Off);
        }
        let (version, held) = {
            let cursor = self.cursor();
            (cursor.version(), cursor.token().is_some())
        };
        let asked = tokio::time::Instant::now();
        let row = self.table.take(&self.owner, options.cursor_lease).await?;
        let taken = self
            .cursor()
            .kept(row, asked, options.cursor_lease, version);
        self.say(&taken);
        match taken {
            Taken::Not => {
                if held {
                    tracing::warn!(
                        table = %self.name,
                        "this relay lost the log's cursor (its lease ended before a renewal \
                         reached the database): another relay reads the log now, and may \
                         publish again what this one had in flight"
                    );
                }
                self.stand_by().await
            }
            Taken::Renewed if held => Ok(Beat::Held),
            Taken::Renewed | Taken::Anew { .. } | Taken::Moved { .. } => {
                *self.standing_by() = None;
                Ok(Beat::Took)
            }
        }
    }

    fn standing_by(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.standing_by.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cursor could not be taken: who holds it, said once per holder.
    async fn stand_by(&self) -> Result<Beat> {
        let holder = self.table.holder().await?;
        let Some((name, left_us)) = holder.and_then(|h| h.owner.map(|o| (o, h.lease_left_us)))
        else {
            // No cursor (a table on the per-row engine), or it was given back a moment
            // ago: the next heartbeat takes it.
            *self.standing_by() = None;
            return Ok(Beat::Off);
        };
        let lease_left = Duration::from_micros(u64::try_from(left_us).unwrap_or(0));
        let mut said = self.standing_by();
        if said.as_deref() != Some(name.as_str()) {
            tracing::info!(
                table = %self.name, holder = %name, lease_ends_in = ?lease_left,
                "another relay holds the log's cursor: this relay stands by (claiming on the \
                 per-row side only), and takes the cursor over if that relay's lease ends \
                 unrenewed"
            );
            *said = Some(name.clone());
        }
        Ok(Beat::Waiting(Holder { name, lease_left }))
    }
}
