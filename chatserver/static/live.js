// The page is told, not polling: one EventSource on /api/events carries this person's changes
// (conversations made, renamed, titled, pinned, deleted; turns started and ended; projects made,
// changed or deleted) from every tab,
// device and server. The browser reconnects by itself; what was missed meanwhile is read again.

export function listen({ conversation, deleted, turn, project, reconnected }) {
  const source = new EventSource("/api/events");
  let opened = false;
  const on = (name, handle) => source.addEventListener(name, (e) => handle(JSON.parse(e.data)));
  on("conversation", conversation);
  on("deleted", deleted);
  on("turn", turn);
  on("project", project);
  source.addEventListener("open", () => {
    // Events are for pages that are connected: after a gap, the list and the open conversation are read again.
    if (opened) reconnected();
    opened = true;
    document.body.dataset.live = "true";
  });
  source.addEventListener("error", () => {
    document.body.dataset.live = "false";
  });
  return source;
}
