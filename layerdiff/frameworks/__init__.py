"""The frameworks behind :mod:`layerdiff.framework`'s interface, one module each: ``torch``
(module hooks), ``flax`` (Flax NNX, through :mod:`layerdiff.flax`), ``external`` (a port that
runs and records itself). Each module's ``FRAMEWORK`` is what ``framework_of`` returns; the
stages never import these modules themselves."""
