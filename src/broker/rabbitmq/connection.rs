//! The publisher's link to the broker: one connection, its idle confirm channels, and
//! reconnecting with backoff; and what a lapin error says about reaching the broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::ConfirmSelectOptions;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::{Channel, Connection, ConnectionStatus, ErrorKind, Event};
use tokio::time::Instant;

use super::RabbitMqPublisher;
use crate::backoff::Backoff;
use crate::publisher::PublishError;

/// The first wait after a failed connect.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// The longest wait between connects: short beside the relay's own outage backoff (at most
/// 5 s between tries), so that a try of the relay after the broker is back finds the
/// publisher ready to connect rather than refusing for seconds more.
const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// The current connection, its idle confirm channels, and when a failed reconnect may be
/// tried again.
///
/// Each batch publishes on a channel of its own: the broker's returns (unroutable messages)
/// arrive on the channel they were published on, and lapin hands them out with whichever
/// confirm of that channel resolves next, so a channel shared by two batches could give one
/// batch's return to the other and let an unroutable message count as sent.
pub(super) struct Link {
    connection: Option<Connection>,
    idle: Vec<Channel>,
    backoff: Backoff,
    retry_at: Option<Instant>,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            connection: None,
            idle: Vec::new(),
            backoff: Backoff::new(RECONNECT_MIN, RECONNECT_MAX),
            retry_at: None,
        }
    }
}

/// The broker's resource-alarm notices on any of the publisher's connections, for the
/// publisher's lifetime: how many times it blocked one (`connection.blocked`) and when it
/// last unblocked one (`connection.unblocked`). A batch notes them when it begins
/// ([`Blocks::begin`]) and asks, if it times out, whether an alarm held it up
/// ([`Blocks::touched`]).
#[derive(Clone, Default)]
pub(super) struct Blocks(Arc<Notices>);

#[derive(Default)]
struct Notices {
    blocked: AtomicU64,
    unblocked_at: std::sync::Mutex<Option<Instant>>,
}

/// What a batch noted of the notices when it began, before it waited for a channel.
#[derive(Clone, Copy)]
pub(super) struct Began {
    blocked: u64,
    at: Instant,
}

impl Blocks {
    /// Notes the notices so far, for a batch that begins now.
    pub(super) fn begin(&self) -> Began {
        Began {
            blocked: self.0.blocked.load(Ordering::SeqCst),
            at: Instant::now(),
        }
    }

    /// Whether the broker blocked one of the connections since `began`, or unblocked one
    /// less than `grace` before it or since. With the connection's own status (blocked
    /// now), this says whether an alarm held a batch up: a wait for its channel, a write or
    /// a confirm held up by an alarm that has just cleared is an outage, not the record's
    /// fault. So is a timeout in the alarm's wake: lapin holds every frame while the
    /// connection is blocked and sends them all once it is unblocked, and the broker then
    /// takes in what every blocked publisher held back. (The count also covers a block whose
    /// unblock notice is still on its way to this listener.)
    pub(super) fn touched(&self, began: Began, grace: Duration) -> bool {
        let unblocked_at = *self
            .0
            .unblocked_at
            .lock()
            .expect("no panic holds this lock");
        self.0.blocked.load(Ordering::SeqCst) != began.blocked
            || unblocked_at.is_some_and(|at| at + grace > began.at)
    }

    /// Records the notices on `connection` until it is gone.
    fn listen(&self, connection: &Connection) {
        let notices = self.0.clone();
        let mut events = connection.events_listener();
        tokio::spawn(async move {
            while let Some(event) = events.next().await {
                match event {
                    Event::ConnectionBlocked(_) => {
                        notices.blocked.fetch_add(1, Ordering::SeqCst);
                    }
                    Event::ConnectionUnblocked => {
                        *notices
                            .unblocked_at
                            .lock()
                            .expect("no panic holds this lock") = Some(Instant::now());
                    }
                    _ => {}
                }
            }
        });
    }
}

/// A confirm channel lent to one batch, with what it needs to know of its connection.
pub(super) struct Lent {
    pub(super) channel: Channel,
    status: ConnectionStatus,
    pub(super) frame_max: u32,
}

impl Lent {
    /// Whether a resource alarm blocks the connection now: lapin writes nothing on it.
    pub(super) fn blocked(&self) -> bool {
        self.status.blocked()
    }
}

impl RabbitMqPublisher {
    /// A confirm channel for one batch's exclusive use, opening a new connection or channel
    /// when needed. Give it back with [`RabbitMqPublisher::give_back`].
    /// Every failure here is an outage: nothing was written.
    pub(super) async fn channel(&self) -> std::result::Result<Lent, String> {
        let mut link = self.link.lock().await;
        let connected = link
            .connection
            .as_ref()
            .is_some_and(|c| c.status().connected());
        if connected {
            while let Some(channel) = link.idle.pop() {
                if channel.status().connected() {
                    let connection = link.connection.as_ref().expect("connected above");
                    return Ok(self.lend(channel, connection));
                }
            }
        } else {
            link.idle.clear();
            if let Some(at) = link.retry_at
                && Instant::now() < at
            {
                return Err(format!(
                    "RabbitMQ at {} is unreachable; reconnecting in {:?}",
                    self.endpoint.name,
                    at - Instant::now()
                ));
            }
            // A broker that accepts the socket but never finishes the handshake must not
            // hold the publisher (and this lock) forever.
            let connecting = tokio::time::timeout(
                self.confirm_timeout,
                self.endpoint.connect(&self.connection_name),
            )
            .await
            .map_err(|_| format!("no handshake within {:?}", self.confirm_timeout))
            .and_then(|connected| connected.map_err(|e| e.to_string()));
            match connecting {
                Ok(connection) => {
                    tracing::info!(endpoint = %self.endpoint.name, "connected to RabbitMQ");
                    self.blocks.listen(&connection);
                    link.connection = Some(connection);
                }
                Err(e) => {
                    let delay = link.backoff.failed();
                    link.retry_at = Some(Instant::now() + delay);
                    // The relay reports the outage; this is the detail.
                    tracing::debug!(endpoint = %self.endpoint.name, error = %e, retry_in = ?delay, "connecting to RabbitMQ failed");
                    return Err(format!(
                        "connecting to RabbitMQ at {} failed: {e}",
                        self.endpoint.name
                    ));
                }
            }
        }
        let connection = link.connection.as_ref().expect("connected above");
        let opening = async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(channel)
        };
        let channel = match tokio::time::timeout(self.confirm_timeout, opening).await {
            Ok(opened) => opened.map_err(|e| {
                format!(
                    "opening a confirm channel on RabbitMQ at {} failed: {e}",
                    self.endpoint.name
                )
            })?,
            Err(_) => {
                return Err(format!(
                    "opening a confirm channel on RabbitMQ at {} took over {:?}",
                    self.endpoint.name, self.confirm_timeout
                ));
            }
        };
        let lent = self.lend(channel, connection);
        link.backoff.reset();
        link.retry_at = None;
        Ok(lent)
    }

    fn lend(&self, channel: Channel, connection: &Connection) -> Lent {
        Lent {
            channel,
            status: connection.status().clone(),
            frame_max: connection.configuration().frame_max(),
        }
    }

    /// Returns a channel after a batch whose confirms all arrived, without waiting for the
    /// link (another batch may hold it while it connects: then on a task of its own).
    pub(super) fn give_back(&self, channel: Channel) {
        if !channel.status().connected() {
            return;
        }
        match self.link.try_lock() {
            Ok(mut link) => link.idle.push(channel),
            Err(_) => {
                let link = self.link.clone();
                tokio::spawn(async move {
                    link.lock().await.idle.push(channel);
                });
            }
        }
    }
}

/// Whether a lapin error from writing a record says the broker is out of reach (an outage:
/// the record was not written) or something about the record failed. A channel or
/// connection the broker closed with an error about what was sent (a refused routing key,
/// say) spends attempts; only a missing exchange and a forced close (a broker shutting
/// down) are outages.
pub(super) fn classify(err: &lapin::Error, text: String) -> PublishError {
    match err.kind() {
        ErrorKind::IOError(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::InvalidChannelState(..)
        | ErrorKind::ChannelsLimitReached => PublishError::unavailable(text),
        _ if closed_by_broker_side(err) => PublishError::unavailable(text),
        _ => PublishError::transient(text),
    }
}

/// The broker closed the channel because what it names does not exist (an exchange or a
/// queue: `NOT_FOUND`).
pub(crate) fn not_found(err: &lapin::Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
    )
}

/// A channel or connection the broker closed for a reason of its own, not of a message's: a
/// missing exchange, or a forced close as the broker shuts down.
pub(super) fn closed_by_broker_side(err: &lapin::Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::ProtocolError(amqp)
            if matches!(
                amqp.kind(),
                AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                    | AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED)
            )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alarm_touches_a_batch_that_it_blocked_or_that_began_in_its_wake() {
        const GRACE: Duration = Duration::from_secs(1);
        let blocks = Blocks::default();
        let unblocked = |ago: Duration| {
            *blocks.0.unblocked_at.lock().unwrap() = Some(Instant::now() - ago);
        };
        let began = blocks.begin();
        assert!(!blocks.touched(began, GRACE), "no alarm at all");

        // Unblocked long before the batch began: its wake is over.
        unblocked(Duration::from_secs(5));
        assert!(!blocks.touched(blocks.begin(), GRACE));
        // Unblocked less than the grace before the batch began, or after.
        unblocked(Duration::from_millis(300));
        assert!(blocks.touched(blocks.begin(), GRACE));
        unblocked(Duration::from_secs(5));
        let began = blocks.begin();
        unblocked(Duration::ZERO);
        assert!(blocks.touched(began, GRACE));

        // Blocked since the batch began, on any of the publisher's connections.
        unblocked(Duration::from_secs(5));
        let began = blocks.begin();
        assert!(!blocks.touched(began, GRACE));
        blocks.0.blocked.fetch_add(1, Ordering::SeqCst);
        assert!(blocks.touched(began, GRACE));
        assert!(
            !blocks.touched(blocks.begin(), GRACE),
            "blocked before it began"
        );
    }
}
