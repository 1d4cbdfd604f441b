"""The client channel's model, shared by both front ends (``argrpc.Channel`` and
``argrpc.aio.Channel``): the target resolved to addresses (``target``), the load-balancing
policy chosen from the options and service config (``lb_policy``), one subchannel per
address (``subchannel``), and the round-robin balancer that picks one per call
(``balancer``). Fast connections themselves are shared process-wide in ``_subchannels``."""
