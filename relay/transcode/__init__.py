"""Transcoding at the relay (docs/relay.md "Transcoding"): the :class:`Transcoder` protocol a
relay is given (``transcoder``), a coded track made once per replica and codec (``edge``) and
a coded SUBSCRIBE coded object by object (``live``).

``relay.transcode.Transcoder`` is the name a transcoder plugin implements
(kvsp_moq/bridge/transcoding.py), so it is re-exported here."""

from .transcoder import Properties, Transcoder

__all__ = ["Properties", "Transcoder"]
