"""The tree layer: what frontends serve. ``base`` declares the interface (``Tree``, entries, attributes, the one
checked read), ``virtual`` is a checkpoint's immutable tree, ``run`` a training run's live tree, ``assemble`` builds a
checkpoint's tree from its views."""
