"""The network configuration (conflist) both CNI plugins, the daemons and tabbyctl read.

::

    common    CommonConf (identity, logging, runtime keys), DatastoreSettings, the shared
              field types, and the mapping of validation errors to CNI codes 2 and 7
    values    what the plugins read of each model, as plain classes the models inherit
              (no pydantic)
    known     configurations validated before, kept by their hash and read back as values
              without pydantic (standalone calls)
    resolve   the daemons' and tabbyctl's datastore settings: flags > env > conflist
    teardown  the configuration as DEL and GC read it: each invalid field dropped to its
              default and reported; what derives from one is unknown, never guessed

Each plugin's own section is its own: ``cni_plugin.config`` (tabby), ``ipam.config``
(tabby-ipam), with their values in ``cni_plugin.values`` and ``ipam.values``. pydantic:
never imported by VERSION, the tabby-node client, or a call whose configuration is known.
"""
