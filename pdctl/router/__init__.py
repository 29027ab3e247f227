"""The embedded PD router (``pdctl router``; started by ``pdctl up``).

Modules: ``app`` (RouterServer: routes, keys, admission, hold/release), ``config`` (settings
and their flags, light: the planner imports it), the request path ``dispatch`` (attempts,
streams and their continuations) over ``selection`` (which workers), ``legs`` (sending to a
worker; ``PairAttempt`` owns a PD attempt's two legs), ``retry`` (the one retry policy) and
``shaping`` (headers, reading and rewriting answers), ``streaming``, ``resume`` and ``continuation`` (a stream's
blocks, continuing answers), ``workers``, ``policies``, and HTTP: ``server`` (writes the
``reply`` a handler returns), ``upstream`` (to engines) and ``http1`` (bytes both write).
Nothing is imported here, so that ``pdctl.router.config`` costs the planner nothing more.
"""
